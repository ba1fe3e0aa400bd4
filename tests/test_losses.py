"""Divergences tested by identities (as TRL tests its generalized JSD) and against a float64 reference."""

import math

import pytest
import torch

from distill.training.losses import (
    distill_loss,
    forward_kl,
    generalized_jsd,
    log_probs,
    reverse_kl,
    top1_agreement,
    tvd,
)

B, S, V = 2, 5, 11


def _logits(seed: int, vocab: int = V, scale: float = 3.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, vocab, generator=g) * scale).to(dtype)


def _mask() -> torch.Tensor:
    # row 0: prompt, prompt, completion x3; row 1: prompt, completion x2, padding x2
    return torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])


def _reference(student, teacher, mask, loss, beta=0.5, temperature=1.0):
    """Straightforward float64 loop over the masked positions, textbook formulas."""
    total, n = 0.0, 0
    for b in range(student.shape[0]):
        for t in range(student.shape[1]):
            if not mask[b, t]:
                continue
            p = torch.softmax(teacher[b, t].double() / temperature, -1)  # target
            q = torch.softmax(student[b, t].double() / temperature, -1)  # draft
            if loss == "fkl":
                d = (p * (p.log() - q.log())).sum()
            elif loss == "rkl":
                d = (q * (q.log() - p.log())).sum()
            elif loss == "tvd":
                d = 1 - torch.minimum(p, q).sum()
            else:
                m = beta * p + (1 - beta) * q
                d = beta * (p * (p.log() - m.log())).sum() + (1 - beta) * (q * (q.log() - m.log())).sum()
            total, n = total + d, n + 1
    return total / n


@pytest.mark.parametrize(
    "loss,beta", [("fkl", 0.5), ("rkl", 0.5), ("tvd", 0.5), ("jsd", 0.1), ("jsd", 0.5), ("jsd", 0.9)]
)
def test_values_and_gradients_match_reference(loss, beta):
    teacher = _logits(1)
    s1 = _logits(2).requires_grad_(True)
    s2 = s1.detach().double().requires_grad_(True)
    got = distill_loss(s1, teacher, _mask(), loss=loss, beta=beta, temperature=1.5)
    want = _reference(s2, teacher, _mask(), loss, beta, temperature=1.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    got.backward()
    want.backward()
    torch.testing.assert_close(s1.grad.double(), s2.grad, rtol=1e-4, atol=1e-6)
    assert s1.grad[_mask() == 0].abs().max() == 0  # prompt and padding positions get no gradient


def test_jsd_end_points_are_forward_and_reverse_kl():
    s, t, m = _logits(3), _logits(4), _mask()
    torch.testing.assert_close(generalized_jsd(s, t, m, beta=0.0), forward_kl(s, t, m))
    torch.testing.assert_close(generalized_jsd(s, t, m, beta=1.0), reverse_kl(s, t, m))
    # direction: forward KL is KL(target || draft), so swapping the models turns one into the other
    torch.testing.assert_close(forward_kl(s, t, m), reverse_kl(t, s, m))
    assert not torch.allclose(forward_kl(s, t, m), reverse_kl(s, t, m))


def test_jsd_scaled_tends_to_kl_near_end_points():
    # JSD(beta) = beta * KL(p_T || p_S) + O(beta^2): the end points are limits, in the same direction
    s, t, m = _logits(3, scale=1.0), _logits(4, scale=1.0), _mask()
    torch.testing.assert_close(generalized_jsd(s, t, m, beta=1e-4) / 1e-4, forward_kl(s, t, m), rtol=2e-3, atol=1e-4)
    torch.testing.assert_close(
        generalized_jsd(s, t, m, beta=1 - 1e-4) / 1e-4, reverse_kl(s, t, m), rtol=2e-3, atol=1e-4
    )


@pytest.mark.parametrize("loss,beta", [("fkl", 0.0), ("rkl", 0.0), ("tvd", 0.0), ("jsd", 0.3), ("jsd", 0.0)])
def test_equal_logits_give_zero(loss, beta):
    x = _logits(5)
    assert distill_loss(x, x.clone(), _mask(), loss=loss, beta=beta).abs() < 1e-6


def test_jsd_half_is_symmetric_and_bounded():
    s, t, m = _logits(6), _logits(7), _mask()
    a, b = generalized_jsd(s, t, m, beta=0.5), generalized_jsd(t, s, m, beta=0.5)
    torch.testing.assert_close(a, b)
    assert 0 < a <= math.log(2)


def test_tvd_in_unit_interval_and_equals_one_minus_overlap():
    s, t, m = _logits(8, scale=10.0), _logits(9, scale=10.0), _mask()
    value = tvd(s, t, m)
    assert 0.0 <= value <= 1.0
    p, q = torch.softmax(t[m.bool()], -1), torch.softmax(s[m.bool()], -1)
    torch.testing.assert_close(value, (1 - torch.minimum(p, q).sum(-1)).mean())
    # disjoint supports -> 1
    far_s = torch.full((1, 1, 4), -1e9)
    far_s[..., 0] = 0
    far_t = torch.full((1, 1, 4), -1e9)
    far_t[..., 3] = 0
    torch.testing.assert_close(tvd(far_s, far_t, torch.ones(1, 1)), torch.tensor(1.0))


def test_padding_and_prompt_positions_are_ignored():
    s, t, m = _logits(10), _logits(11), _mask()
    base = forward_kl(s, t, m)
    s2, t2 = s.clone(), t.clone()
    s2[m == 0] = torch.randn_like(s2[m == 0]) * 100  # garbage where the mask is 0
    t2[m == 0] = 7.0
    torch.testing.assert_close(forward_kl(s2, t2, m), base)
    # mean per token, not per sequence: one long and one short completion weigh by their token counts
    only0 = torch.zeros_like(m)
    only0[0] = m[0]
    only1 = m - only0
    want = (forward_kl(s, t, only0) * 3 + forward_kl(s, t, only1) * 2) / 5
    torch.testing.assert_close(base, want)


def test_all_zero_mask_is_a_clear_error():
    with pytest.raises(ValueError, match="no completion tokens"):
        forward_kl(_logits(1), _logits(2), torch.zeros(B, S))
    with pytest.raises(ValueError, match="no completion tokens"):
        top1_agreement(_logits(1), _logits(2), torch.zeros(B, S))


def test_padded_teacher_vocab_is_sliced_to_shared_range():
    s, t, m = _logits(12), _logits(13), _mask()
    padded = torch.cat([t, torch.randn(B, S, 5) * 50], -1)  # target embedding padded beyond the tokenizer
    torch.testing.assert_close(forward_kl(s, padded, m), forward_kl(s, t, m))
    torch.testing.assert_close(tvd(s, padded, m), tvd(s, t, m))
    # explicit shared range narrower than both
    torch.testing.assert_close(forward_kl(s, padded, m, vocab_size=7), forward_kl(s[..., :7], t[..., :7], m))
    with pytest.raises(ValueError, match="vocab_size"):
        forward_kl(s, padded, m, vocab_size=V + 1)


def test_shape_errors():
    with pytest.raises(ValueError, match="shape mismatch"):
        forward_kl(_logits(1), _logits(2)[:, :-1], _mask())
    with pytest.raises(ValueError, match="not one of"):
        distill_loss(_logits(1), _logits(2), _mask(), loss="kl")


def test_bf16_logits_are_computed_in_float32():
    s, t, m = _logits(14, dtype=torch.bfloat16), _logits(15, dtype=torch.bfloat16), _mask()
    got = forward_kl(s, t, m)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, forward_kl(s.float(), t.float(), m))
    assert forward_kl(s, s.clone(), m) == 0


@pytest.mark.parametrize("loss", ["fkl", "rkl", "jsd", "tvd"])
def test_top_k_equal_to_vocab_is_the_full_loss(loss):
    s, t, m = _logits(16), _logits(17), _mask()
    full = distill_loss(s, t, m, loss=loss, beta=0.3)
    torch.testing.assert_close(distill_loss(s, t, m, loss=loss, beta=0.3, top_k=V), full)
    # k = V - 1 leaves a one-token tail bucket: the coarsening of a single token is exact for every loss
    torch.testing.assert_close(distill_loss(s, t, m, loss=loss, beta=0.3, top_k=V - 1), full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", ["fkl", "rkl", "jsd", "tvd"])
def test_top_k_tail_bucket_matches_explicit_coarsening(loss):
    k = 3
    teacher = _logits(18)
    s1 = _logits(19).requires_grad_(True)
    s2 = s1.detach().double().requires_grad_(True)
    got = distill_loss(s1, teacher, _mask(), loss=loss, beta=0.4, top_k=k, temperature=0.7)
    # reference: full float64 softmaxes, then probabilities merged into [top-k ids of the teacher..., rest]
    keep = _mask().bool()
    p = torch.softmax(teacher[keep].double() / 0.7, -1)
    q = torch.softmax(s2[keep] / 0.7, -1)
    ids = teacher[keep].topk(k, -1).indices
    pk, qk = p.gather(-1, ids), q.gather(-1, ids)
    p2 = torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1)
    q2 = torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1)
    if loss == "fkl":
        want = (p2 * (p2.log() - q2.log())).sum(-1).mean()
    elif loss == "rkl":
        want = (q2 * (q2.log() - p2.log())).sum(-1).mean()
    elif loss == "tvd":
        want = 0.5 * (p2 - q2).abs().sum(-1).mean()
    else:
        mix = 0.4 * p2 + 0.6 * q2
        want = (0.4 * (p2 * (p2.log() - mix.log())).sum(-1) + 0.6 * (q2 * (q2.log() - mix.log())).sum(-1)).mean()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    got.backward()
    want.backward()
    torch.testing.assert_close(s1.grad.double(), s2.grad, rtol=1e-4, atol=1e-6)
    # a coarsening never increases a divergence
    assert got <= distill_loss(s1.detach(), teacher, _mask(), loss=loss, beta=0.4, temperature=0.7) + 1e-6


def test_top_k_shapes_and_normalisation():
    log_ps, log_pt = log_probs(_logits(20), _logits(21), _mask(), top_k=4)
    assert log_ps.shape == log_pt.shape == (5, 5)  # 5 completion tokens, k + tail
    torch.testing.assert_close(log_ps.exp().sum(-1), torch.ones(5))
    torch.testing.assert_close(log_pt.exp().sum(-1), torch.ones(5))


def test_masked_minus_inf_logits_stay_finite():
    s, t, m = _logits(22), _logits(23), _mask()
    t[..., -2:] = float("-inf")  # the target never emits the last two ids
    s.requires_grad_(True)
    for loss in ("fkl", "jsd", "tvd"):
        value = distill_loss(s, t, m, loss=loss)
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(s.grad).all()


def test_top1_agreement():
    t = _logits(24)
    s = t.clone()
    assert top1_agreement(s, t, _mask()) == 1.0
    s[0, 2] = -t[0, 2]  # one of five completion positions now disagrees
    torch.testing.assert_close(top1_agreement(s, t, _mask()), torch.tensor(0.8))
    assert not top1_agreement(s.requires_grad_(True), t, _mask()).requires_grad


@pytest.mark.parametrize("chunk", [1, 40, 1 << 17])  # one row per chunk, a ragged last chunk, one chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_kl_matches_the_unfused_loss(monkeypatch, chunk, dtype):
    """The fused, chunked forward KL against the textbook log-softmax path: value and gradient, with a padded
    teacher vocabulary, a temperature, -inf teacher logits and bf16 student logits."""
    from distill.training import losses

    monkeypatch.setitem(losses._CHUNK_ELEMENTS, "cpu", chunk)
    teacher = _logits(30, vocab=V + 3)  # padded past the shared range
    teacher[..., 2] = float("-inf")
    s1 = _logits(31, dtype=dtype).requires_grad_(True)
    s2 = s1.detach().clone().requires_grad_(True)
    got = losses.fused_forward_kl(s1, teacher, _mask(), temperature=0.8, vocab_size=V)
    log_ps, log_pt = log_probs(s2, teacher, _mask(), temperature=0.8, vocab_size=V)
    want = losses.forward_kl_per_token(log_ps, log_pt).mean()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (got * 2.0).backward()
    (want * 2.0).backward()
    assert s1.grad.dtype == dtype and torch.isfinite(s1.grad).all()
    tol = {"rtol": 1e-2, "atol": 1e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(s1.grad, s2.grad, **tol)
    assert s1.grad[_mask() == 0].abs().max() == 0
    assert forward_kl(s1.detach(), s1.detach().float(), _mask()) == 0  # identical distributions: exactly 0


def test_loss_speed_bench_runs_and_both_methods_agree():
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "loss_speed.py"
    cmd = [sys.executable, str(script), "--tokens", "12", "--vocab", "40", "--repeats", "1", "--dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    values = [float(v) for v in re.findall(r"value (\d+\.\d+)", out.stdout)]
    assert len(values) == 2 and values[0] == pytest.approx(values[1], rel=1e-5) and "x faster" in out.stdout
