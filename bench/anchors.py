"""The shapes the benchmarks share (one list, imported by bench/kernels.py and runtime_overhead.py).

ANCHORS: (N, K) of common decode GEMVs, large to small. LLAMA_8B: Llama-3.1-8B's per-layer projections
(hidden 4096, 32 query and 8 key/value heads of 128, MLP 14336, vocabulary 128256), what an end-to-end decode
step reads once per layer, and the activations each distinct input is quantized for.
"""

ANCHORS = [(4096, 4096), (14336, 4096), (4096, 14336), (5120, 5120), (27648, 5120), (5120, 27648),
           (151936, 4096), (1024, 4096), (512, 2048)]

LLAMA_8B_LAYERS = 32
LLAMA_8B_LAYER = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096),
                  "gate": (14336, 4096), "up": (14336, 4096), "down": (4096, 14336)}
LLAMA_8B_LM_HEAD = (128256, 4096)
# Distinct inputs per layer, by K: the normed x (q, k, v), the attention output (o), the normed h (gate, up),
# the MLP activation (down). The lm_head adds one more K = 4096 input.
LLAMA_8B_QUANTIZED_PER_LAYER = {4096: 3, 14336: 1}
