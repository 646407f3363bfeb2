"""The CPU kernels under the model: C/C++ sources (``csrc/``), their build and loading (``build``),
the ctypes wrappers (``dense``, ``gguf``, ``attention``), the custom ops (``ops``, the one module
that defines them) and the backends a runner swaps in for the plain model's modules (``linear``:
dense, GGUF-block and int8 linears and embeddings; ``attention``: the C paged attention).

Nothing here imports ``duoserve.model``: the backends take plain tensors and values, and the
runner (``duoserve.worker``) puts them into the model at the edge.
"""
