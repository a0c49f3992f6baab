"""specserve's CPU kernels: weight-quantized linears (Q4, Q8, BF16 weights x bf16 activations)
and paged attention over the K/V pool, each computing an output row with one fixed operation
order that does not depend on the batch, the chunk, the verify window or the thread count.

The C++ sources are in csrc/ and built once per machine (`python -m specserve.kernels.self_test`,
run by scripts/setup.sh). Two code paths exist: AVX512-BF16 and a portable generic one; the
path is chosen once per process from the CPU's flags (SPECSERVE_CPU_KERNEL_PATH forces one), and
on a CPU with AVX512-BF16 both give bitwise-equal results.
"""
