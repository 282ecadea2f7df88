"""The closed forms K3.md pins (sections 2-5) and the AttnRes paper's pipeline-communication sums."""
import pytest

from k3c.analysis import formulas as F


@pytest.mark.parametrize("C, D", [(64, 128), (16, 128), (32, 64)])
def test_kda_prefill_per_chunk_and_head(C, D):
    assert F.kda_prefill_flops(C, D) == 12 * C ** 3 + 8 * C ** 2 * D + 6 * C * D ** 2
    assert F.kda_prefill_bytes(C, D) == 8 * C ** 2 + 22 * C * D


def test_kda_prefill_values():
    assert F.kda_prefill_flops(64, 128) == 13_631_488      # 3,145,728 + 4,194,304 + 6,291,456
    assert F.kda_prefill_bytes(64, 128) == 212_992          # 32,768 + 180,224
    assert F.kda_prefill_flops(16, 128) == 49_152 + 262_144 + 1_572_864


def test_kda_decode_per_head_and_token():
    assert F.kda_decode_flops(128) == 7 * 128 ** 2 == 114_688
    assert F.kda_decode_bytes(128) == 8 * 128 ** 2 == 131_072     # fp32 state read + write: 2 x D^2 x 4


def test_mla_mqa_mha_ratio_deepseek_v3():
    shapes = dict(P=128, R=64, V=128, L=512)
    assert F.mla_pair_flops("mha", **shapes) == 640
    assert F.mla_pair_flops("mqa", **shapes) == 2176
    assert F.mla_mqa_mha_ratio(**shapes) == pytest.approx(3.4, abs=1e-12)
    with pytest.raises(ValueError):
        F.mla_pair_flops("gqa", **shapes)


def test_attnres_prefill_storage_15_gb_is_decimal():
    b = F.attnres_block_bytes(8, 128 * 1024, 7168, 2)
    assert b == 15_032_385_536
    assert round(b / F.GB) == 15 and f"{b / F.GB:.2f}" == "15.03"     # 15 GB = 15.03e9 bytes
    assert b / F.GiB == 14.0                                            # exactly 14 GiB, not 15
    assert F.fmt_bytes(b) == "15.03 GB (14.00 GiB)"


def test_moe_comm_compute_ratio():
    # (P F)/(6 m B) (1 - 1/E)
    assert F.moe_comm_compute_ratio(2, 1e15, 2048, 400e9, 8) == pytest.approx(2 * 1e15 / (6 * 2048 * 400e9) * 7 / 8)
    assert F.moe_comm_compute_ratio(4, 5e15, 3072, 153.6e9, 1) == 0.0       # no expert parallelism: no traffic
    base = F.moe_comm_compute_ratio(3, 5e15, 3072, 153.6e9, 8)
    assert F.moe_comm_compute_ratio(6, 5e15, 3072, 153.6e9, 8) == pytest.approx(2 * base)
    assert F.moe_comm_compute_ratio(3, 5e15, 6144, 153.6e9, 8) == pytest.approx(base / 2)
    assert F.moe_comm_compute_ratio(3, 5e15, 3072, 307.2e9, 8) == pytest.approx(base / 2)
    # K3 on MI355X, MXFP8 dispatch (1 + 1/32 B) + bf16 combine (2 B), F = FP8 peak
    assert F.moe_comm_compute_ratio(3.03125, 5e15, 3072, 153.6e9, 8) == pytest.approx(4.68, abs=0.005)


def test_attnres_pipeline_communication():
    # naive: sum_{j=1}^{C-1} j N_p; cached: N_p [P(P-1)/2 + (V-1) P^2]
    assert F.attnres_pp_naive_blocks(4, 2, 1) == 28
    assert F.attnres_pp_cached_blocks(4, 2, 1) == 6 + 16
    assert F.attnres_pp_cached_blocks(4, 1, 1) == F.attnres_pp_naive_blocks(4, 1, 1)   # one virtual stage: same
    assert F.attnres_pp_naive_blocks(8, 4, 0.5) == 0.5 * 32 * 31 / 2
    # the saving grows with V (about V/2 for large V)
    r = [F.attnres_pp_naive_blocks(4, v, 1) / F.attnres_pp_cached_blocks(4, v, 1) for v in (1, 2, 4, 8, 16)]
    assert r == sorted(r) and r[0] == 1.0 and r[-1] > 7


def test_mxfp4_bytes_and_expert_hits():
    assert F.mxfp4_bytes(3072, 3584) * 8 == 3072 * 3584 * 4.25        # 4.25 bits per weight
    assert F.mxfp4_bytes(1, 33) == 17 + 2                              # ragged K: ceil(K/2) + ceil(K/32)
    assert F.experts_touched(112, 16, 896, 0) == 0
    assert F.experts_touched(112, 16, 896, 1) == pytest.approx(112 * 16 / 896)
    assert F.experts_touched(112, 16, 896, 100_000) == pytest.approx(112)
