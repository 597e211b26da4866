"""Tolerances of the FP8 communication tests, each named once with its reason (STYLE.md habit 7).

SQNR is ``20 log10(||ref|| / ||fp8 - ref||)`` against the fp32 mean over ranks (``tests.numerics.sqnr``).
"""

# SQNR is a statistic over a tensor: below this many elements one unlucky rounding dominates it (a single value
# can err by 2**-3 of itself in E5M2, 18 dB); smaller tensors are held to an elementwise rounding bound instead.
MIN_SQNR_NUMEL = 32
# Those small tensors' bound, elementwise relative to the tensor's largest value: two E5M2 roundings of 2**-3 each.
SMALL_TENSOR_RTOL = 2.0**-2

# One E5M2 rounding (2 mantissa bits, relative error <= 2**-3) gives ~25 dB on Gaussian data. The portable
# all-reduce rounds twice (each rank's cast, then the requantized mean): ~23 dB on average, but a small tensor whose
# energy sits in a few large values (log-uniform magnitudes) scatters by +-3 dB (19.5 dB seen on 4 ranks): 18 dB.
ALLREDUCE_E5M2_SQNR_DB = 18.0
# E4M3 has one more mantissa bit: ~6 dB more per rounding (~28 dB observed for two roundings).
ALLREDUCE_E4M3_SQNR_DB = 25.0
# A reduce-scatter (FSDP) rounds once, on each rank's cast; the sum runs in fp32 (~25 dB observed).
REDUCE_SCATTER_E5M2_SQNR_DB = 22.0
# What a broken reduction looks like: an underflowed (all-zero) result has 0 dB; anything under 3 dB carries
# essentially no signal. The naive variants must land below this.
BROKEN_SQNR_DB = 3.0

# Bytes on the wire per gradient element for the reduction, normalized so that an all-reduce of dtype d counts
# itemsize(d) (4.0 for fp32): FP8 data is 1.0, the chunks' padding to an aligned size and the scales add the rest
# (a few bytes per element for buckets of a few elements; the tests' buckets are large enough for 1.1).
MAX_WIRE_BYTES_PER_ELEMENT = 1.1

# Training 50 steps with FP8 communication against fp32 communication (same data, same init): the loss curves
# may differ by FP8 gradient noise (~5% relative per step on individual gradients), which AdamW partly averages
# out. 5% relative on the final loss bounds it; the FP8 run must also converge (loss falls below half its start).
TRAINING_FINAL_LOSS_RTOL = 0.05

# The FSDP1 and FSDP2 route sweeps (test_routes_fsdp1.py, test_routes_fsdp2.py), against the unsharded model on the
# global batch: the gradients of one step. The reference's own FP8 casts err too: its E4M3 input and E5M2 grad_output
# casts take the global batch's amax, each rank's its own, so the gap is that of two independent roundings, 3 dB under
# one (17 to 25 dB observed on 3 ranks, with or without FP8 communication; FP8 communication adds one E5M2 rounding on
# the reduce-scatter, two with FSDP1's NO_SHARD). A wrong mean (a sum, a double division) gives 6 dB or less.
GRAD_SQNR_DB = 15.0
# bf16 parameters (a bf16 model, or FSDP's bf16 param_dtype): bf16 rounding of every activation on top (~14 dB seen).
GRAD_BF16_SQNR_DB = 12.0
# Three AdamW steps (lr 1e-2) of FP8-rounded gradients: the updates are near lr * sign(g), and a small gradient a
# rounding flips moves its weight by 2 lr (the embedding's sparse rows: ~10 dB observed, the FP8 weights' 12 to 15 dB).
# The weights' change from their start is held to this SQNR against the reference's: no update, or updates of random
# signs, give 0 dB or less (Adam does not see a wrong gradient scale: the first step's gradients are checked for that).
UPDATE_SQNR_DB = 6.0
LOSS_RTOL = 0.02  # the first losses: forward casts differ by per-rank input amaxes only
NORM_RTOL = 0.02  # a gradient norm over ~4000 values: the FP8 roundings average out
