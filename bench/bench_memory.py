"""Peak memory and tokens/s of a target in bf16 vs 4-bit NF4, during distillation and decoding.

    HF_HUB_OFFLINE=1 python bench/bench_memory.py --json bench_memory.json

Configurations: {reference target `$PAIR/target` (30M Llama; default runs/stdlib-pair), a larger random-init Llama
built here from `LARGE_CONFIG` (hidden 1024, 10 layers, intermediate 2816, vocab 8192, ~137M parameters, the
reference tokenizer)} x {bf16, nf4}. The draft is always the reference draft (`stdlib-pair/draft`, float32, full
weights). Every target loads through the product's own path, `distill.models.load_target(ModelConfig(...))`; nf4
is bitsandbytes 4-bit NF4 with bf16 compute and no double quantization.

Each configuration runs in a fresh subprocess (`--worker`) so one model's allocations never pollute another's peak.
In each worker, three phases, the process's RSS high-water mark reset before each one (Linux
`/proc/self/clear_refs`; where that is unavailable the peaks are cumulative and the table says so):

* load: target + draft; peak RSS (VmHWM, the counter behind `ru_maxrss`, which is recorded too but also carries the
  parent's peak across fork + exec) and the target's `get_memory_footprint()`. bf16 safetensors are mmapped and
  reach the RSS only when first read (decode), so load-phase RSS understates bf16; 4-bit weights are materialised.
* decode: greedy, 64 new tokens (EOS ignored, so every row emits exactly 64) on 4 dev prompts in one left-padded
  batch: `decode.speculative.speculative_generate(target, draft)` (gamma 5) and `target_generate`, after a short
  warm-up of each; tokens/s = emitted tokens / wall time. Runs before distillation so the draft is the reference one.
* distill: `--steps` (default 3) AdamW steps of the draft on one batch of 8 x 192 tokens packed from
  `$PAIR/prompts/stdlib-train.jsonl`: teacher forward under no_grad, draft forward/backward,
  `distill.training.losses.distill_loss` (forward KL, every position), optimizer step. tokens/s over the steps
  after the first (the first is a warm-up), counting batch x seq tokens per step.

On CUDA the workers also report `torch.cuda.max_memory_allocated()` per phase; on CPU the memory columns are RSS
only (the whole process: Python, torch, both models, activations, optimizer state). Options: `--threads N`
(torch.set_num_threads; default torch's choice), `--steps`, `--models ref,large`, `--dtypes bf16,nf4`.
Exits 0 with a message when the pair or its prompt files are absent.

`--eagle3` measures instead one training step of an EAGLE-3 head at each sequence length of `--seq` (default
1024,2048,4096), for the head shapes of `--heads` (`HEAD_SHAPES`: `smollm2`, SmolLM2-135M's head at batch 4 over
an 8192-token draft vocabulary; `llama8b`, Llama-3.1-8B's head at batch 1 over 32000 tokens), both from configs
with random weights:

    HF_HUB_OFFLINE=1 python bench/bench_memory.py --eagle3 --heads llama8b --seq 1024,2048,4096 --json e3.json

No target runs: the target's side of the batch (its aux hidden states in bf16, its log-probabilities over the
draft vocabulary) is random of the right shapes, and the head reads a bf16 embedding of the target's vocabulary
(the target's own, which the head shares). Each (head, length) runs in a fresh worker: a warm-up step at 64
tokens (so AdamW's state exists), then the measured step: `decode.kinds.eagle3.train_step.head_loss` (3 unrolled steps,
forward KL, every position; `--recompute`: with `distill.recompute`), backward, the training loop's AdamW step.
It reports the step's peak RSS (VmHWM reset just before it) and the RSS before it (the head, its AdamW state, the
embedding, the batch's target side), whose difference is the step's own memory; on CUDA also
`max_memory_allocated`. `--timeout` bounds each worker (an 8B-shaped head at 4096 tokens takes ~30 min on 2 cores).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # workers import decode/distill from a source checkout without installing
# The stdlib reference pair and its prompt files as recipes/pretrain and docs/data.md build them; PAIR=DIR elsewhere.
PAIR = Path(os.environ.get("PAIR", ROOT / "runs" / "stdlib-pair"))
TRAIN_PROMPTS = Path(os.environ.get("TRAIN_PROMPTS", PAIR / "prompts" / "stdlib-train.jsonl"))
DEV_PROMPTS = Path(os.environ.get("DEV_PROMPTS", PAIR / "prompts" / "stdlib-eval.jsonl"))

# The larger random-init target: the reference architecture scaled up (same vocabulary and special ids).
LARGE_CONFIG = dict(
    hidden_size=1024,
    num_hidden_layers=10,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=64,
    vocab_size=8192,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# Targets whose EAGLE-3 head --eagle3 trains (never built: the head is made from the config alone), and its batch.
HEAD_SHAPES = {
    "smollm2": dict(
        config=dict(
            hidden_size=576,
            num_hidden_layers=30,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            max_position_embeddings=8192,
        ),
        draft_vocab=8192,
        batch=4,
    ),
    "llama8b": dict(
        config=dict(
            hidden_size=4096,
            num_hidden_layers=32,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            max_position_embeddings=131072,
        ),
        draft_vocab=32000,
        batch=1,
    ),
}
GB = 1e9

BATCH, SEQ = 8, 192  # distillation batch
NEW_TOKENS, N_DEV, GAMMA = 64, 4, 5  # decoding
MB = 1024 * 1024


# ---------------------------------------------------------------------------------------------------------------
# Memory probes (worker side)
# ---------------------------------------------------------------------------------------------------------------
def _maxrss_mb() -> float:
    """Peak RSS of this process in MiB: VmHWM, else ru_maxrss (KiB on Linux, bytes on macOS).

    VmHWM is the counter behind ru_maxrss for this address space, but ru_maxrss also keeps the *parent's* peak
    across fork + exec (Linux folds the old mm's high-water mark into it), so a worker started by a 1 GB parent
    would report >= 1 GB whatever it does; VmHWM starts from the worker's own pages and clear_refs resets it.
    """
    hwm = _status_mb("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MB if sys.platform == "darwin" else peak / 1024


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _rss_mb() -> float | None:
    return _status_mb("VmRSS")


def _reset_peak() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Phase:
    """Reset the RSS (and CUDA) peak on entry; record peak RSS / CUDA max allocated on exit into `out`."""

    def __init__(self, name: str, out: dict, device) -> None:
        self.name, self.out, self.device = name, out, device

    def __enter__(self) -> Phase:
        import torch

        gc.collect()
        self.out["peak_reset"] = _reset_peak() and self.out.get("peak_reset", True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.out[f"{self.name}_cuda_max_alloc_mb"] = torch.cuda.max_memory_allocated(self.device) / MB
        self.out[f"{self.name}_peak_rss_mb"] = _maxrss_mb()
        self.out[f"{self.name}_ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------------------------
# Worker: one (model, dtype) configuration
# ---------------------------------------------------------------------------------------------------------------
def _train_batch(tok):
    """[BATCH, SEQ] ids packed from the training prompts (EOS between prompts), in file order."""
    import torch

    from decode.prompts import load_prompts

    ids: list[int] = []
    for item in load_prompts(TRAIN_PROMPTS):
        ids += tok(item["prompt"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if len(ids) >= BATCH * SEQ:
            break
    if len(ids) < BATCH * SEQ:
        raise ValueError(f"{TRAIN_PROMPTS} holds only {len(ids)} tokens; need {BATCH * SEQ}")
    return torch.tensor(ids[: BATCH * SEQ]).view(BATCH, SEQ)


def worker(target_path: str, dtype: str, steps: int, threads: int | None) -> dict:
    import torch

    from decode.prompts import encode_prompts, load_prompts, make_batches
    from decode.speculative import speculative_generate, target_generate
    from distill.config import ModelConfig, QuantConfig
    from distill.models import check_compatible, load_draft, load_target, load_tokenizer, resolve_device
    from distill.training.losses import distill_loss

    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    res: dict = {"device": str(device), "threads": torch.get_num_threads(), "rss_before_load_mb": _rss_mb()}

    # ---- load (the product's path)
    nf4 = dict(bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16", bnb_4bit_use_double_quant=False)
    quant = QuantConfig(load_in_4bit=True, **nf4)
    tcfg = ModelConfig(model=target_path, dtype="bfloat16", quantization=quant if dtype == "nf4" else QuantConfig())
    with Phase("load", res, device):
        t0 = time.perf_counter()
        target = load_target(tcfg, device)
        draft = load_draft(ModelConfig(model=str(PAIR / "draft")), device)
        sync()
        res["load_s"] = time.perf_counter() - t0
    res["target_footprint_mb"] = target.get_memory_footprint() / MB
    res["draft_footprint_mb"] = draft.get_memory_footprint() / MB
    res["rss_after_load_mb"] = _rss_mb()
    tok = load_tokenizer(target_path)
    vocab = check_compatible(target, draft, tok, load_tokenizer(str(PAIR / "draft")))

    # ---- decode: greedy, NEW_TOKENS per row, EOS ignored so every row runs the full budget
    prompts = load_prompts(DEV_PROMPTS)[:N_DEV]
    ids, mask = make_batches(encode_prompts(tok, prompts), N_DEV, tok.pad_token_id)[0]
    ids, mask = ids.to(device), mask.to(device)
    with Phase("decode", res, device):
        # warm-up (bnb CPU kernel repack)
        target_generate(target, ids, mask, max_new_tokens=4, eos_token_id=[], vocab=vocab)
        speculative_generate(
            target, draft, ids, mask, max_new_tokens=4, num_draft_tokens=GAMMA, eos_token_id=[], vocab=vocab
        )
        sync()
        t0 = time.perf_counter()
        out = target_generate(target, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=[], vocab=vocab)
        sync()
        res["target_only_tok_s"] = out.stats.new_tokens / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = speculative_generate(
            target, draft, ids, mask, max_new_tokens=NEW_TOKENS, num_draft_tokens=GAMMA, eos_token_id=[], vocab=vocab
        )
        sync()
        res["spec_tok_s"] = out.stats.new_tokens / (time.perf_counter() - t0)
        res["acceptance"] = out.stats.accepted / max(out.stats.drafted, 1)
    del out

    # ---- distill: teacher forward (no_grad) + draft forward/backward + AdamW step
    batch = _train_batch(tok).to(device)
    attn = torch.ones_like(batch)
    loss_mask = torch.ones_like(batch)
    draft.train()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    times, losses = [], []
    with Phase("distill", res, device):
        for _ in range(steps):
            t0 = time.perf_counter()
            with torch.no_grad():
                teacher = target(input_ids=batch, attention_mask=attn).logits
            student = draft(input_ids=batch, attention_mask=attn).logits
            loss = distill_loss(student, teacher, loss_mask, loss="fkl", vocab_size=vocab)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
            del teacher, student, loss
    timed = times[1:] or times
    res["distill_tok_s"] = BATCH * SEQ * len(timed) / sum(timed)
    res["distill_step_s"] = times
    res["distill_loss"] = losses
    return res


def _random_side(head, batch: int, seq: int, device):
    """A training batch of ``seq`` tokens per row and a random target side for it (bf16 features)."""
    import torch

    from decode.kinds.eagle3.train_step import TargetSide

    config, vd = head.config, len(head.draft_ids)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, -1] = 0  # every position but the last predicts a token (loss_positions: all)
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    features = torch.randn(batch, seq, 3 * config.target_hidden_size, device=device, dtype=torch.bfloat16)
    log_p = torch.randn(batch, seq, vd + 1, device=device).log_softmax(-1)
    top = head.draft_ids[torch.randint(0, vd, (batch, seq), device=device)]
    return data, TargetSide(features, log_p, top, computed=0)


def eagle3_worker(shape: str, seq: int, threads: int | None, recompute: bool = False) -> dict:
    """One training step of ``HEAD_SHAPES[shape]``'s head at ``seq`` tokens per row (module docstring)."""
    import torch
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    from decode.kinds.eagle3 import decoding as eagle3
    from decode.kinds.eagle3 import train_step
    from distill.config import DistillConfig, TrainConfig
    from distill.models import resolve_device
    from distill.training.helpers import build_optimizer

    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    spec = HEAD_SHAPES[shape]
    torch.manual_seed(0)
    with torch.device("meta"):  # the target's config and modules, no weights
        target = LlamaForCausalLM(LlamaConfig(**spec["config"]))
    config = eagle3.head_config(target, spec["draft_vocab"])
    embed = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16)
    embed.requires_grad_(False)
    draft_ids = torch.randperm(config.vocab_size)[: spec["draft_vocab"]].sort().values.tolist()
    head = eagle3.Eagle3Head(config, embed, draft_ids).to(device)
    model = train_step.Unrolled(head)
    opt = build_optimizer(model, TrainConfig())  # the training loop's AdamW
    cfg = DistillConfig(recompute=recompute)
    res: dict = {"device": str(device), "threads": torch.get_num_threads(), "head": shape, "seq": seq}
    res["recompute"] = recompute
    res["batch"] = batch = spec["batch"]
    res["head_params_m"] = sum(p.numel() for p in head.parameters()) / 1e6

    def step(data, side) -> float:
        loss, _ = train_step.head_loss(model, side, data, cfg)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return float(loss.detach())

    step(*_random_side(head, batch, 64, device))  # warm-up: AdamW's state exists from here on
    data, side = _random_side(head, batch, seq, device)
    gc.collect()
    res["rss_before_step_mb"] = _rss_mb()
    with Phase("step", res, device):
        t0 = time.perf_counter()
        res["loss"] = step(data, side)
        res["step_s"] = time.perf_counter() - t0
    return res


def run_worker(cmd: list[str], out: Path, timeout_s: float) -> dict:
    """One measurement in a fresh process (its peak RSS is its own): the JSON it wrote to `out`, or {"error"}."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s}s"}
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        return {"error": f"exit {proc.returncode}: {lines[-1]}"}
    return json.loads(out.read_text())


def eagle3_table(rows: list[dict]) -> str:
    cuda = any("step_cuda_max_alloc_mb" in r for r in rows)
    head = ["head", "batch", "S", "recompute", "peak RSS MiB", "RSS before the step MiB", "the step's own MiB"]
    head += ["step s"]
    head += ["CUDA max alloc MiB"] if cuda else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['head']} | — | {r['seq']} | — | failed: {r['error']} |")
            continue
        cells = [r["head"], str(r["batch"]), str(r["seq"]), "yes" if r["recompute"] else "no"]
        cells += [_fmt(r["step_peak_rss_mb"]), _fmt(r["rss_before_step_mb"])]
        cells += [_fmt(r["step_peak_rss_mb"] - r["rss_before_step_mb"]), _fmt(r["step_s"], ".1f")]
        cells += [_fmt(r.get("step_cuda_max_alloc_mb"))] if cuda else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def eagle3_goals(rows: list[dict]) -> list[str]:
    """The linearity and 16 GB checks, one line each, for the lengths measured."""
    lines = []
    by = {(r["head"], r["seq"]): r for r in rows if "error" not in r}
    for (shape, seq), r in sorted(by.items()):
        half = by.get((shape, seq // 2))
        if half is not None:
            whole = r["step_peak_rss_mb"] / half["step_peak_rss_mb"]
            own = (r["step_peak_rss_mb"] - r["rss_before_step_mb"]) / (
                half["step_peak_rss_mb"] - half["rss_before_step_mb"]
            )
            lines.append(f"{shape}: S={seq} / S={seq // 2}: peak RSS x{whole:.2f}, the step's own memory x{own:.2f}")
        if shape == "llama8b" and seq == 4096:
            peak = r["step_peak_rss_mb"] * MB / GB
            lines.append(f"llama8b at S=4096: peak RSS {peak:.1f} GB ({'within' if peak <= 16 else 'over'} 16 GB)")
    return lines


def eagle3_main(args) -> int:
    start = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for shape in [h.strip() for h in args.heads.split(",") if h.strip()]:
            for seq in [int(s) for s in args.seq.split(",") if s.strip()]:
                row = {"head": shape, "seq": seq}
                out = Path(tmp) / f"{shape}-{seq}.json"
                cmd = [sys.executable, __file__, "--eagle3-worker", shape, str(seq), "--worker-out", str(out)]
                cmd += (["--threads", str(args.threads)] if args.threads else []) + (["--recompute"] * args.recompute)
                print(f"[{time.perf_counter() - start:6.1f}s] {shape} S={seq} ...", file=sys.stderr, flush=True)
                row.update(run_worker(cmd, out, args.timeout))
                rows.append(row)
    total = time.perf_counter() - start
    print(eagle3_table(rows))
    ok = [r for r in rows if "error" not in r]
    device = ok[0]["device"] if ok else "?"
    print("\n" + "\n".join(eagle3_goals(rows)))
    print(f"device: {device}; threads {ok[0]['threads'] if ok else '?'}; total {total:.0f}s; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    if args.json:
        summary = {"rows": rows, "total_s": total, "loadavg": os.getloadavg(), "argv": sys.argv}
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if len(ok) == len(rows) else 1


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------
def build_large(directory: Path) -> None:
    """Save the random-init LARGE_CONFIG Llama (bf16, seed 0) with the reference tokenizer (run in a subprocess)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LARGE_CONFIG)).to(torch.bfloat16)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (PAIR / "target" / name).is_file():
            shutil.copy(PAIR / "target" / name, directory / name)


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def _fmt(value, spec: str = ".0f") -> str:
    return "—" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    cuda = any("load_cuda_max_alloc_mb" in r for r in rows)
    head = [
        "target", "params", "dtype", "footprint MiB", "RSS peak load MiB", "RSS peak decode MiB",
        "RSS peak distill MiB", "distill tok/s", "target-only tok/s", "speculative tok/s", "acceptance",
    ]  # fmt: skip
    if cuda:
        head += ["CUDA max alloc load / decode / distill MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {_fmt(r.get('params_m'), '.0f')}M | {r['dtype']} | failed: {r['error']} |")
            continue
        cells = [
            r["model"],
            f"{r['params_m']:.0f}M",
            r["dtype"],
            _fmt(r["target_footprint_mb"]),
            _fmt(r["load_peak_rss_mb"]),
            _fmt(r["decode_peak_rss_mb"]),
            _fmt(r["distill_peak_rss_mb"]),
            _fmt(r["distill_tok_s"]),
            _fmt(r["target_only_tok_s"], ".1f"),
            _fmt(r["spec_tok_s"], ".1f"),
            _fmt(r["acceptance"], ".2f"),
        ]
        if cuda:
            cells.append(" / ".join(_fmt(r.get(f"{p}_cuda_max_alloc_mb")) for p in ("load", "decode", "distill")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--steps", type=int, default=3, help="distillation steps per configuration (first = warm-up)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each worker")
    ap.add_argument("--models", default="ref,large", help="comma list of ref, large")
    ap.add_argument("--dtypes", default="bf16,nf4", help="comma list of bf16, nf4")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    ap.add_argument("--eagle3", action="store_true", help="measure an EAGLE-3 head's training step instead")
    ap.add_argument("--heads", default="smollm2,llama8b", help="--eagle3: comma list of " + ", ".join(HEAD_SHAPES))
    ap.add_argument("--seq", default="1024,2048,4096", help="--eagle3: comma list of sequence lengths")
    ap.add_argument("--recompute", action="store_true", help="--eagle3: with distill.recompute (rerun each layer)")
    ap.add_argument("--eagle3-worker", nargs=2, metavar=("HEAD", "SEQ"), help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs=2, metavar=("TARGET", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--build-large", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.build_large:
        build_large(Path(args.build_large))
        return 0

    if args.worker:
        res = worker(args.worker[0], args.worker[1], args.steps, args.threads)
        Path(args.worker_out).write_text(json.dumps(res))
        return 0
    if args.eagle3_worker:
        res = eagle3_worker(args.eagle3_worker[0], int(args.eagle3_worker[1]), args.threads, args.recompute)
        Path(args.worker_out).write_text(json.dumps(res))
        return 0
    if args.eagle3:
        return eagle3_main(args)

    if not (PAIR / "target").is_dir() or not TRAIN_PROMPTS.is_file() or not DEV_PROMPTS.is_file():
        print(f"skipped: {PAIR} (reference pair and its prompt files) is absent; set PAIR=DIR")
        return 0

    start = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        targets = {}
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        if "ref" in models:
            targets["ref"] = (PAIR / "target", _prod_params(PAIR / "target"))
        if "large" in models:
            large = Path(tmp) / "large"
            subprocess.run([sys.executable, __file__, "--build-large", str(large)], cwd=ROOT, check=True)
            targets["large"] = (large, _prod_params(large))
        for name, (path, n_params) in targets.items():
            for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
                row = {"model": name, "dtype": dtype, "params_m": n_params / 1e6, "target_path": str(path)}
                out = Path(tmp) / f"{name}-{dtype}.json"
                cmd = [sys.executable, __file__, "--worker", str(path), dtype, "--worker-out", str(out)]
                cmd += ["--steps", str(args.steps)] + (["--threads", str(args.threads)] if args.threads else [])
                print(f"[{time.perf_counter() - start:6.1f}s] {name} {dtype} ...", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                row.update(run_worker(cmd, out, args.timeout))
                row["wall_s"] = time.perf_counter() - t0
                rows.append(row)

    total = time.perf_counter() - start
    print(table(rows))
    ok = [r for r in rows if "error" not in r]
    device = ok[0]["device"] if ok else "?"
    notes = [f"device: {device}; total {total:.0f}s; load average {os.getloadavg()[0]:.2f}"]
    if ok and ok[0]["device"].startswith("cpu"):
        notes.append("CPU: memory is process RSS only (no CUDA allocator figures)")
    if any(not r.get("peak_reset", True) for r in ok):
        notes.append("RSS peaks are cumulative (high-water mark reset unavailable)")
    print("\n" + "; ".join(notes))
    if args.json:
        summary = {"rows": rows, "total_s": total, "loadavg": os.getloadavg(), "argv": sys.argv}
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if len(ok) == len(rows) else 1


def _prod_params(path: Path) -> int:
    """Parameter count of a saved model from its safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                n += _prod(st.get_slice(key).get_shape())
    return n


if __name__ == "__main__":
    sys.exit(main())
