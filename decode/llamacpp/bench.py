"""``python -m decode bench --engine llamacpp``: a draft inside llama.cpp's ``llama-server`` against llama.cpp
target-only.

    python -m decode bench --engine llamacpp --target T.gguf|T_HF_DIR --draft D.gguf|DRAFT_DIR --prompts P.jsonl \\
        [--num-draft-tokens 4|auto] [--threads N] [--ctx-size 4096] [--n-batch 512] [--llama-cpp DIR] ...

Two ``llama-server`` processes on 127.0.0.1, one slot each, the same threads, context and batch: target-only, and
the target with the draft (``-md``, the speculative type that serves the draft's kind, a fixed draft length:
``--spec-draft-n-max K --spec-draft-n-min 0 --spec-draft-p-min 0``). Both get the same token ids (the target-only
server's ``/tokenize``, chat rows rendered by its ``/apply-template``), one request per prompt, the servers taking
turns at going first; ``--repeats`` times, the median per prompt. Timings are llama-server's own (``prompt_ms +
predicted_ms``: no HTTP in them); acceptance comes from each reply's ``draft_n`` / ``draft_n_accepted`` and the
server's ``/metrics`` counters (rounds and per-position accepts), over the timed requests only.

The verify-cost curve and the choice of K for ``--num-draft-tokens auto`` are in ``decode.llamacpp.curve``: auto
first runs a short pilot at the longest draft, then takes the K with the highest tau(K) / (v(K + 1) + draft
cost(K)) from the pilot's per-position acceptance, and says plainly when no K can pay. The models as GGUF files (an
HF folder converted once into draftsmith's cache) are ``decode.llamacpp.models``.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from decode.llamacpp.binaries import LlamaCpp, build_number, check_spec_type, find
from decode.llamacpp.curve import (
    MAX_K,
    PER_POS,
    ROUNDS,
    bench_command,
    cannot_pay,
    choose_k,
    counter_delta,
    draft_cost_at,
    draft_cost_per_round,
    interpolate,
    parse_llama_bench,
    per_position,
)
from decode.llamacpp.models import GgufInfo, check_fit, draft_gguf, max_draft, read_gguf, resolve_kind, target_gguf
from decode.llamacpp.server import Server, ServerFailed, last_lines, parse_metrics, physical_cores

DEFAULT_CTX = 4096
DEFAULT_BATCH = 512
PILOT_PROMPTS = 4
OUTTYPES = {None: "f32", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # --dtype -> converter outtype


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp's own measurements: the verify-cost curve (llama-bench), tokens/s
# ---------------------------------------------------------------------------------------------------------------
def verify_cost_curve(
    lc: LlamaCpp, model: Path, depth: int, threads: int, n_batch: int, max_k: int = MAX_K
) -> dict[int, float]:
    """Run llama-bench on the target (:func:`bench_command`) and return :func:`parse_llama_bench`'s curve."""
    cmd = bench_command(lc.tool("llama-bench"), model, depth, threads, n_batch, max_k)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired:
        raise ValueError("llama-bench did not finish the verify-cost curve in an hour") from None
    if proc.returncode != 0:
        raise ValueError(f"llama-bench failed on {model.name} (status {proc.returncode}): {last_lines(proc.stderr)}")
    return parse_llama_bench(proc.stdout, max_k)


def paired_units(fast: list[list[tuple[float, float]]], base: list[list[tuple[float, float]]]) -> tuple[list, list]:
    """(tokens, seconds) units for the bench's paired interval (``decode.metrics.speedup_ci95``): per prompt the
    medians over repeats, or with a single prompt its repeats (each ran both servers back to back), as
    ``decode.bench`` pairs its batches."""
    if len(fast) > 1:
        return [_median_unit(u) for u in fast], [_median_unit(u) for u in base]
    return list(fast[0]), list(base[0])


def _median_unit(units: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(n for n, _ in units), statistics.median(s for _, s in units)


def rate(units: list[list[tuple[float, float]]]) -> float:
    """Tokens/s: per prompt the median over repeats of tokens and of seconds, summed over prompts."""
    medians = [_median_unit(u) for u in units]
    seconds = sum(s for _, s in medians)
    return sum(n for n, _ in medians) / seconds if seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------------------------
# The servers
# ---------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def server_flags(exe: str) -> frozenset[str]:
    """Every ``--flag`` a llama-server build lists in its ``--help``."""
    import re

    try:
        proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset(re.findall(r"(--[a-z0-9][a-z0-9-]*)", proc.stdout + proc.stderr))


@dataclass(frozen=True)
class Setup:
    """What both servers share, stated in the JSON."""

    threads: int
    ctx: int
    n_batch: int


def server_command(exe: Path, model: Path, setup: Setup, flags: frozenset[str]) -> list[str]:
    """llama-server target-only: one slot, no web UI, no prompt cache, /metrics on."""
    cmd = [
        str(exe), "-m", str(model), "-t", str(setup.threads), "-tb", str(setup.threads), "-c", str(setup.ctx),
        "-b", str(setup.n_batch), "-ub", str(setup.n_batch), "--parallel", "1", "--metrics",
    ]  # fmt: skip
    if "--no-webui" in flags:
        cmd.append("--no-webui")
    if "--cache-ram" in flags:  # no prompt cache between requests: every request pays its whole prompt
        cmd += ["--cache-ram", "0"]
    return cmd


def speculative_command(
    exe: Path, model: Path, draft: Path, spec_type: str, k: int, setup: Setup, flags: frozenset[str],
    probabilistic: bool,
) -> list[str]:  # fmt: skip
    """llama-server with the draft: a fixed draft length K (no minimum, no confidence cut: ``p-min 0``)."""
    cmd = server_command(exe, model, setup, flags) + [
        "-md", str(draft), "--spec-type", spec_type, "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
        "--spec-draft-p-min", "0", "-td", str(setup.threads), "-tbd", str(setup.threads),
    ]  # fmt: skip
    if probabilistic:
        cmd += ["--spec-draft-sampling", "probabilistic"]
    return cmd


def tokenize(server: Server, row: dict, has_template: bool) -> list[int]:
    """The token ids of a prompt row, by the server's own tokenizer (a chat row rendered by its chat template:
    special tokens only as the template writes them)."""
    if row.get("messages"):
        messages = row["messages"][:-1] if row["messages"][-1]["role"] == "assistant" else row["messages"]
        if not has_template:
            raise ValueError(
                "chat prompts need a chat template, and the target GGUF has none (tokenizer.chat_template): give "
                'the rows a "prompt" string instead'
            )
        text = server.post("/apply-template", {"messages": messages})["prompt"]
        add_special = False
    else:
        text, add_special = row["prompt"], True
    return server.post("/tokenize", {"content": text, "add_special": add_special, "parse_special": True})["tokens"]


def completion(server: Server, ids: list[int], sampling: dict) -> dict:
    """One /completion of ``ids``; {"tokens", "seconds", "n", "predicted_ms", "drafted", "accepted", "text"}."""
    reply = server.post("/completion", {"prompt": ids, **sampling})
    t = reply["timings"]
    tokens = reply.get("tokens") or []
    return {
        "tokens": list(tokens),
        "n": int(t["predicted_n"]),
        "seconds": (t["prompt_ms"] + t["predicted_ms"]) / 1000.0,
        "prompt_ms": t["prompt_ms"],
        "predicted_ms": t["predicted_ms"],
        "drafted": int(t.get("draft_n", 0)),
        "accepted": int(t.get("draft_n_accepted", 0)),
        "text": reply.get("content", ""),
    }


def sampling_body(max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int) -> dict:
    """The request's sampling: the bench's settings, llama.cpp's other samplers off (min_p defaults to 0.05)."""
    return {
        "n_predict": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": 0.0,
        "seed": seed, "cache_prompt": False, "return_tokens": True, "stream": False,
    }  # fmt: skip


def metrics(server: Server) -> dict:
    return parse_metrics(server.get_text("/metrics"))


# ---------------------------------------------------------------------------------------------------------------
# The bench
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What the bench runs, settled before any server starts."""

    lc: LlamaCpp
    exe: Path  # llama-server
    build: int | None
    flags: frozenset[str]  # what this llama-server's --help lists
    kind: str
    spec_type: str
    block: bool  # the draft proposes its whole block in one forward
    probabilistic: bool  # drafts sampled and verified by rejection (T > 0), else greedy drafts, sample-and-match
    target: GgufInfo
    draft: GgufInfo
    setup: Setup
    max_k: int  # the longest draft auto considers (a block draft: its block)
    has_bench: bool  # llama-bench is there: the verify-cost curve is measured


def check_settings(num_draft_tokens: int | str, repeats: int, dtype: str | None, draft_sample_method: str) -> str:
    """The bench's own settings; the converter's outtype for ``dtype``."""
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if num_draft_tokens != "auto":
        if not isinstance(num_draft_tokens, int) or isinstance(num_draft_tokens, bool):
            raise ValueError(
                f"--engine llamacpp drafts a fixed number of tokens: --num-draft-tokens N or auto, not "
                f"{num_draft_tokens!r}"
            )
        if not 1 <= num_draft_tokens <= 256:
            raise ValueError(f"--num-draft-tokens {num_draft_tokens}: choose 1..256 or auto")
    from decode.vllm_engine import SAMPLE_METHODS  # stdlib only: the same three choices as vLLM's engine

    if draft_sample_method not in SAMPLE_METHODS:
        raise ValueError(f"--draft-sample-method {draft_sample_method!r}: choose {', '.join(SAMPLE_METHODS)}")
    if dtype not in OUTTYPES:
        raise ValueError(f"--dtype {dtype}: --engine llamacpp converts to one of float32, bfloat16, float16")
    return OUTTYPES[dtype]


def make_plan(
    target: str, draft: str, *, llama_cpp: str | None, auto: bool, temperature: float, draft_sample_method: str,
    outtype: str, threads: int | None, ctx: int | None, n_batch: int,
) -> Plan:  # fmt: skip
    """Find llama.cpp, check it serves the draft, have both models as GGUF files that fit each other.

    Raises:
        ValueError: one line each: llama.cpp missing (LlamaCppMissing), a build without the draft's speculative type,
            a kind llama.cpp does not serve, a model the converter refuses (ConversionFailed), a draft that does not
            fit the target.
    """
    from decode import kinds

    lc = find(llama_cpp, need="llama-server")
    exe = lc.tool("llama-server")
    kind, draft_info = resolve_kind(draft)
    kinds.gguf(kind)  # refuses a kind llama.cpp has no speculative type for, naming what serves it
    traits = kinds.traits(kind)
    check_spec_type(exe, traits.llamacpp_spec_type)
    build = build_number(exe)
    flags = server_flags(str(exe))
    if auto:
        lc.tool("llama-bench")  # auto needs the verify-cost curve: refused now, not after the pilot
    probabilistic = temperature > 0 and draft_sample_method != "greedy" and "--spec-draft-sampling" in flags
    if temperature > 0 and draft_sample_method == "probabilistic" and not probabilistic:
        raise ValueError(
            f"llama.cpp build {build} has no --spec-draft-sampling (it drafts greedily): update llama.cpp or "
            "use --draft-sample-method greedy"
        )
    target_path = target_gguf(target, outtype, lc)
    target_hf = None if target_path == Path(target).expanduser() else Path(target).expanduser()
    target_info = read_gguf(target_path, "--target")
    draft_path = draft_gguf(draft, kind, target_hf, outtype, lc, target_info)
    draft_info = draft_info or read_gguf(draft_path, "--draft")
    check_fit(target_info, draft_info, traits.reads_hidden_states)
    ctx = ctx or DEFAULT_CTX
    return Plan(
        lc=lc, exe=exe, build=build, flags=flags, kind=kind, spec_type=traits.llamacpp_spec_type,
        block=traits.block, probabilistic=probabilistic, target=target_info, draft=draft_info,
        setup=Setup(threads or physical_cores(), min(ctx, target_info.context_length or ctx), n_batch),
        max_k=min(MAX_K, max_draft(draft_info) or MAX_K), has_bench=(lc.bin_dir / "llama-bench").is_file(),
    )  # fmt: skip


def encode(base: Server, prompts: list[dict], plan: Plan, max_new_tokens: int, k: int) -> list[list[int]]:
    """The prompts' token ids (:func:`tokenize`), checked against the servers' context."""
    encoded = [tokenize(base, row, plan.target.has_chat_template) for row in prompts]
    if any(not ids for ids in encoded):
        raise ValueError("a prompt has no tokens: drop empty prompts from --prompts")
    need = max(len(ids) for ids in encoded) + max_new_tokens + k + 1
    if need > plan.setup.ctx:
        raise ValueError(
            f"the longest prompt plus --max-new-tokens and the draft ({need} positions) is past the context of "
            f"{plan.setup.ctx}: raise --ctx-size (the target allows {plan.target.context_length}) or shorten them"
        )
    return encoded


def run_llamacpp_bench(
    target: str,
    draft: str,
    prompts: list[dict],
    *,
    llama_cpp: str | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_draft_tokens: int | str = 5,
    draft_sample_method: str = "auto",
    repeats: int = 3,
    seed: int = 0,
    threads: int | None = None,
    ctx: int | None = None,
    n_batch: int = DEFAULT_BATCH,
    dtype: str | None = None,
    samples_out: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Time llama-server with ``draft`` against llama-server target-only on ``prompts``; the bench JSON dict.

    ``target``: a GGUF file or an HF model folder; ``draft``: a GGUF file or a saved draft folder; ``prompts``:
    prompt-file rows (``decode.prompts.load_prompts``). The rest as ``python -m decode bench``.

    Raises:
        ValueError: a bad input, one line (:func:`make_plan`); everything but the prompts' context is checked before
            any server starts.
        UnwrittenOutput: measured, but ``samples_out`` could not be written; it carries the figures.
    """
    if not prompts:
        raise ValueError("no prompts to bench")
    outtype = check_settings(num_draft_tokens, repeats, dtype, draft_sample_method)
    auto = num_draft_tokens == "auto"
    plan = make_plan(
        target, draft, llama_cpp=llama_cpp, auto=auto, temperature=temperature,
        draft_sample_method=draft_sample_method, outtype=outtype, threads=threads, ctx=ctx, n_batch=n_batch,
    )  # fmt: skip
    # llama.cpp clamps a block draft's K to its block: the K the JSON states is the one it ran
    k = plan.max_k if auto else min(int(num_draft_tokens), max_draft(plan.draft) or int(num_draft_tokens))
    setup = plan.setup

    def body(i: int, r: int) -> dict:  # the same seed for both servers on a prompt and repeat
        return sampling_body(max_new_tokens, temperature, top_p, top_k, seed + 1000 * r + i)

    def spec_server(k: int, name: str) -> Server:
        cmd = speculative_command(
            plan.exe, plan.target.path, plan.draft.path, plan.spec_type, k, setup, plan.flags, plan.probabilistic
        )
        return Server(cmd, name)

    from decode.bench import _load_avg, result_header

    load_start = _load_avg()
    with Server(server_command(plan.exe, plan.target.path, setup, plan.flags), "target-only") as base:
        encoded = encode(base, prompts, plan, max_new_tokens, k)
        depth = int(statistics.median(len(ids) for ids in encoded)) + max_new_tokens // 2
        curve = None
        if plan.has_bench:  # the servers idle meanwhile
            curve = verify_cost_curve(plan.lc, plan.target.path, depth, setup.threads, setup.n_batch, MAX_K)
        choice = None
        if auto:
            with spec_server(k, "speculative pilot") as pilot:
                choice = run_pilot(base, pilot, encoded[:PILOT_PROMPTS], body, curve, plan.block)
            k = choice["k"]
            if not choice["pays"]:
                print(cannot_pay(choice), file=sys.stderr)
            elif progress:
                print(f"draft length: K={k} is expected fastest of 1..{choice['pilot_k']} (pilot)", file=sys.stderr)
        with spec_server(k, "speculative") as spec:
            measured = timed_runs(base, spec, encoded, body, repeats, progress)

    result = {
        **result_header(
            target, draft, len(prompts), max_new_tokens, temperature, top_p, top_k, 1, num_draft_tokens
        ),  # fmt: skip
        **figures(measured, prompts, curve=curve, block=plan.block, k=k, temperature=temperature, seed=seed),
        "num_draft_tokens_used": k,
        "auto": _auto_record(choice, plan.max_k) if choice else None,
        **engine_record(plan, depth, repeats, seed),
        "load_avg": {"start": load_start, "end": _load_avg()},
    }
    if samples_out is not None:
        from decode.files import UnwrittenOutput, os_reason, write_whole

        try:
            write_whole(samples_out, lambda tmp: _write_samples(tmp, prompts, measured))
        except OSError as e:  # the figures are measured: they travel with the error
            raise UnwrittenOutput(result, f"{samples_out}: not written ({os_reason(e)})") from e
    return result


def engine_record(plan: Plan, depth: int, repeats: int, seed: int) -> dict:
    """The bench JSON's keys that say what llama.cpp ran, and how."""
    return {
        "engine": "llamacpp",
        "engine_version": f"b{plan.build}" if plan.build is not None else None,
        "llama_cpp_build": plan.build,
        "llama_cpp_bin": str(plan.lc.bin_dir),
        "draft_kind": plan.kind,
        "spec_type": plan.spec_type,
        "draft_sampling": "probabilistic" if plan.probabilistic else "greedy",
        "target_gguf": str(plan.target.path),
        "draft_gguf": str(plan.draft.path),
        "target_quantization": plan.target.file_type,
        "draft_quantization": plan.draft.file_type,
        "threads": plan.setup.threads,
        "ctx": plan.setup.ctx,
        "batch": {"n_batch": plan.setup.n_batch, "n_ubatch": plan.setup.n_batch},
        "verify_cost_depth": depth,
        "repeats": repeats,
        "seed": seed,
    }


def run_pilot(base: Server, pilot: Server, encoded: list[list[int]], body, curve, block: bool) -> dict:
    """Auto's pilot: each pilot prompt once through both servers (the draft at its longest), then
    :func:`choose_k` from its per-position acceptance and draft cost."""
    target_ms, target_n = 0.0, 0
    spec_ms, drafted = 0.0, 0
    completion(base, encoded[0], body(0, 0))  # warm-up
    completion(pilot, encoded[0], body(0, 0))
    before = metrics(pilot)
    for i, ids in enumerate(encoded):
        t = completion(base, ids, body(i, 0))
        s = completion(pilot, ids, body(i, 0))
        target_ms, target_n = target_ms + t["predicted_ms"], target_n + t["n"]
        spec_ms, drafted = spec_ms + s["predicted_ms"], drafted + s["drafted"]
    counters = counter_delta(before, metrics(pilot))
    rates = per_position(counters)
    if rates is None:
        raise ValueError(
            "this llama-server reports no per-position acceptance in /metrics "
            f"({PER_POS}), which --num-draft-tokens auto chooses K from: update llama.cpp or give "
            "--num-draft-tokens N"
        )
    cost = draft_cost_per_round(spec_ms, counters[ROUNDS], drafted, target_ms / max(target_n, 1), curve)
    if cost is None or not rates:
        raise ValueError(
            "the auto pilot drafted nothing (no speculative rounds): check that the draft serves with this target, "
            "or give --num-draft-tokens N"
        )
    choice = choose_k(rates, curve, cost, block, len(rates))
    return {**choice, "pilot_prompts": len(encoded), "pilot_k": len(rates), "per_position_acceptance": rates,
            "draft_cost_per_round": cost}  # fmt: skip


def _auto_record(choice: dict, max_k: int) -> dict:
    keep = ("k", "pays", "pilot_prompts", "pilot_k", "per_position_acceptance", "draft_cost_per_round")
    return {
        **{key: choice[key] for key in keep},
        "expected_speedup": {str(k): x for k, x in choice["expected_speedup"].items()},
        "max_k": max_k,
        "rule": "K maximising tokens(K) / (v(K + 1) + draft cost(K)) from the pilot's per-position acceptance",
    }


@dataclass
class Measured:
    """The timed requests: per method, per prompt, one (tokens, seconds) per repeat; first-repeat outputs; the
    speculative server's counters over the timed requests."""

    units: dict[str, list[list[tuple[float, float]]]]
    decode_ms: dict[str, float]
    tokens: dict[str, list[list[int]]]
    texts: dict[str, list[str]]
    drafted: int
    accepted: int
    counters: dict


def timed_runs(base: Server, spec: Server, encoded: list[list[int]], body, repeats: int, progress: bool) -> Measured:
    """Warm-up, then every prompt through both servers ``repeats`` times, the first server alternating per prompt
    and repeat."""
    servers = {"target": base, "speculative": spec}
    for server in servers.values():  # warm-up: first-call paths, page cache
        completion(server, encoded[0], body(0, 0))
    before = metrics(spec)
    units = {m: [[] for _ in encoded] for m in servers}
    decode_ms = {m: 0.0 for m in servers}
    tokens: dict[str, list[list[int]]] = {m: [[] for _ in encoded] for m in servers}
    texts: dict[str, list[str]] = {m: ["" for _ in encoded] for m in servers}
    drafted = accepted = 0
    total = repeats * len(encoded)
    for r in range(repeats):
        for i, ids in enumerate(encoded):
            order = ["target", "speculative"] if (r + i) % 2 == 0 else ["speculative", "target"]
            for m in order:
                reply = completion(servers[m], ids, body(i, r))
                units[m][i].append((reply["n"], reply["seconds"]))
                decode_ms[m] += reply["predicted_ms"]
                if m == "speculative":
                    drafted, accepted = drafted + reply["drafted"], accepted + reply["accepted"]
                if r == 0:
                    tokens[m][i], texts[m][i] = reply["tokens"], reply["text"]
            if progress:
                print(f"\rllama.cpp bench {r * len(encoded) + i + 1}/{total}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return Measured(units, decode_ms, tokens, texts, drafted, accepted, counter_delta(before, metrics(spec)))


def figures(measured: Measured, prompts: list[dict], *, curve, block: bool, k: int, temperature: float,
            seed: int) -> dict:  # fmt: skip
    """The bench JSON's measured keys from the timed requests."""
    from decode.metrics import leviathan_bound, solve_acceptance, speedup_ci95
    from decode.vllm_engine import first_divergences

    units = measured.units
    rates = {m: rate(units[m]) for m in units}
    counters = measured.counters
    rounds = counters[ROUNDS]  # None: a build without the rounds counter; what needs it is null
    drafted, accepted = measured.drafted, measured.accepted  # the replies' own draft_n / draft_n_accepted
    tau = 1.0 + accepted / rounds if rounds else (1.0 if rounds == 0 else None)
    acceptance = accepted / drafted if drafted else 0.0
    mean_k = drafted / rounds if rounds else (0.0 if rounds == 0 else None)
    n_target = sum(n for u in units["target"] for n, _ in u)
    target_ms_per_token = measured.decode_ms["target"] / n_target if n_target else 0.0
    cost = draft_cost_per_round(measured.decode_ms["speculative"], rounds, drafted, target_ms_per_token, curve)
    # the contract's c: one draft forward in target forwards (a chain: per drafted token; a block: its one forward)
    c = draft_cost_at(1, cost, block) if cost else None
    v = interpolate(curve, mean_k) if curve and mean_k is not None else None
    theory = tau / (draft_cost_at(k, cost, block) + curve[k]) if cost and curve and k in curve else None
    bound = leviathan_bound(solve_acceptance(tau, mean_k), mean_k, c) if c is not None and tau else None
    fast, slow = paired_units(units["speculative"], units["target"])
    per_prompt = [
        (nf / sf) * (sb / nb) if sf > 0 and nb > 0 else None
        for (nf, sf), (nb, sb) in zip(map(_median_unit, units["speculative"]), map(_median_unit, units["target"]))
    ]
    ci = speedup_ci95(fast, slow, seed=seed)
    match, agreement = None, None
    if temperature == 0:
        divergences = first_divergences(measured.tokens["speculative"], measured.tokens["target"])
        rows = len(measured.tokens["target"])
        agreement = {"rows": rows, "rows_equal": {"speculative": rows - len(divergences)}, "divergences": divergences}
        match = not divergences
    rates_pp = per_position(counters)  # None: this llama-server does not report them
    rounds_int = int(rounds) if rounds is not None else None
    judged = [rounds, *counters[PER_POS][:-1]][: len(rates_pp)] if rates_pp is not None else None
    return {
        "acceptance_rate": acceptance,
        "mean_accepted_length": tau,
        "per_position_acceptance": rates_pp,
        "per_position_judged": [int(j) for j in judged] if judged is not None else None,
        "per_position_reported": rates_pp is not None,
        "mean_num_draft_tokens": mean_k,
        "acceptance": {"drafted": drafted, "accepted": accepted, "rate": acceptance, "rounds": rounds_int},
        "tau": tau,
        "draft_cost_ratio": c,
        "verify_cost_ratio": v,
        "leviathan_bound": bound,
        "theoretical_speedup": theory,
        "verify_cost_curve": {str(kk): x for kk, x in curve.items()} if curve else None,
        "draft_cost_per_round": cost,
        "tokens_per_s": {"speculative": rates["speculative"], "target": rates["target"], "hf_assisted": None},
        # generation alone (predicted_ms), all timed requests: what the draft changes, without the prompt
        "decode_tokens_per_s": {m: _decode_rate(units[m], measured.decode_ms[m]) for m in units},
        "speedup": {
            "vs_target": rates["speculative"] / rates["target"] if rates["target"] else None,
            "vs_target_ci95": ci,
            "interval": ci,
            "vs_hf_assisted": None,
        },
        "speedup_per_batch": {
            "prompt_ids": [[str(p.get("id", i))] for i, p in enumerate(prompts)],
            "vs_target": per_prompt,
        },
        "outputs_match_target": match,
        "greedy_agreement": agreement,
        "spec_decode_counters": counters,
        "rounds": rounds_int,
        "generated_tokens": int(sum(n for u in units["speculative"] for n, _ in u)),
        "timing": "llama-server's prompt_ms + predicted_ms per request, median over repeats per prompt",
    }


def _decode_rate(units: list[list[tuple[float, float]]], ms: float) -> float | None:
    return sum(n for u in units for n, _ in u) / (ms / 1000.0) if ms > 0 else None


def _write_samples(path, prompts: list[dict], measured: Measured) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for i, item in enumerate(prompts):
            for method in ("speculative", "target"):
                line = {"id": item.get("id", i), "method": method, "new_token_ids": measured.tokens[method][i],
                        "text": measured.texts[method][i]}  # fmt: skip
                f.write(json.dumps(line) + "\n")


def bench_llamacpp(args) -> dict:
    """``python -m decode bench --engine llamacpp``: the CLI's options checked, then :func:`run_llamacpp_bench`."""
    from decode.prompts import load_prompts

    if args.batch_size != 1:
        raise ValueError("--engine llamacpp runs one request at a time (one slot per server): use --batch-size 1")
    if args.device != "auto":
        raise ValueError("--engine llamacpp runs where the llama.cpp build runs: drop --device")
    if args.draft_dtype:
        raise ValueError("--engine llamacpp converts the draft with --dtype: drop --draft-dtype")
    if args.draft_vocab not in ("auto", "full"):
        raise ValueError("--engine llamacpp runs the draft with its full output layer: drop --draft-vocab")
    if args.baselines is not None and tuple(args.baselines) != ("target",):
        raise ValueError("--engine llamacpp measures against llama.cpp target-only: use --baselines target or drop it")
    for flag, value in (("--threads", args.threads), ("--ctx-size", args.ctx_size), ("--n-batch", args.n_batch)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    prompts = load_prompts(args.prompts)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    return run_llamacpp_bench(
        args.target, args.draft, prompts, llama_cpp=args.llama_cpp, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, num_draft_tokens=args.num_draft_tokens,
        draft_sample_method=args.draft_sample_method, repeats=args.repeats, seed=args.seed, threads=args.threads,
        ctx=args.ctx_size, n_batch=args.n_batch or DEFAULT_BATCH, dtype=args.dtype, samples_out=args.samples_out,
        progress=not args.no_progress,
    )  # fmt: skip


__all__ = [
    "GgufInfo",
    "ServerFailed",
    "bench_llamacpp",
    "check_fit",
    "choose_k",
    "parse_llama_bench",
    "read_gguf",
    "run_llamacpp_bench",
]
