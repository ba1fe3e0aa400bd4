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
  `distill.losses.distill_loss` (forward KL, every position), optimizer step. tokens/s over the steps after the
  first (the first is a warm-up), counting batch x seq tokens per step.

On CUDA the workers also report `torch.cuda.max_memory_allocated()` per phase; on CPU the memory columns are RSS
only (the whole process: Python, torch, both models, activations, optimizer state). Options: `--threads N`
(torch.set_num_threads; default torch's choice), `--steps`, `--models ref,large`, `--dtypes bf16,nf4`.
Exits 0 with a message when the pair or its prompt files are absent.
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
    from distill.losses import distill_loss
    from distill.models import check_compatible, load_draft, load_target, load_tokenizer, resolve_device

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
                try:
                    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
                    if proc.returncode != 0:
                        lines = proc.stderr.strip().splitlines() or ["no output"]
                        row["error"] = f"exit {proc.returncode}: {lines[-1]}"
                    else:
                        row.update(json.loads(out.read_text()))
                except subprocess.TimeoutExpired:
                    row["error"] = f"timed out after {args.timeout}s"
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
