"""A decoder's linear layer: y = x @ weight.T + bias, by the backend routed for x's row count.

Linear(weight, bias) computes through F.linear ("mkl": MKL on the CPU, cuBLAS on a GPU)
until `route(routes)` says otherwise. routes is a list of (below, backend): the first entry
whose `below` exceeds the rows M of x (None: any M) names the backend. "dot" multiplies by the
same dense weight in C++ (pagedserve.kernels.linear_cpu; CPU float32, exact up to the order
of the sums). The other backends
multiply by a copy of the weight prepared once, when a route first names them: "onednn" by a
weight prepacked for oneDNN (`torch.ops.mkldnn`, CPU, exact float32), "panel" by the weight in
column panels for pagedserve's C++ kernel (pagedserve.kernels.panel_cpu; CPU float32, exact up
to the order of the sums), "int8" by per-channel
int8 weights (pagedserve.executor.linear_int8), "int4" by the Q4_1 GGUF's own 4-bit weights read back
from the float32 ones (pagedserve.executor.linear_int4); both with bfloat16 activations, not exact,
opt-in only. If preparing or a call raises, the layer logs what happened and uses F.linear
from then on (that call included). `drop_dense()`, for a layer whose every route has its own copy and
that owns its weight (built from a tensor, not from a Parameter it shares such as a tied
embedding), frees the dense copy (else the weights are held twice); its failures then raise.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor import linear_int4, linear_int8
from pagedserve.kernels import fused_cpu, linear_cpu, panel_cpu

BACKENDS = ("mkl", "onednn", "dot", "panel", "int8", "int4")
DENSE = ("mkl", "dot")  # multiply by the dense weight itself: no copy of their own
PACKED = ("onednn", "panel")  # exact float32 on a copy of their own (a layer holds at most one)
NAMES = {"mkl": "F.linear", "onednn": "oneDNN", "dot": "the C++ dot-product kernel",
         "panel": "the C++ panel kernel", "int8": "int8", "int4": "int4"}

log = logging.getLogger("pagedserve.executor")


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepare(backend: str, weight: torch.Tensor):
    """The copy of `weight` that `backend` multiplies by (raises where it cannot serve)."""
    if backend == "onednn":
        return onednn_pack(weight)
    if backend == "panel":
        return panel_cpu.pack(weight)
    if backend == "int4":
        return linear_int4.pack(weight)
    why = linear_int8.unsupported(weight)
    if why is not None:
        raise ValueError(why)
    return linear_int8.quantize(weight)


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        p = lambda t: t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.owns_weight = not isinstance(weight, nn.Parameter)  # a Parameter passed in is
        self.weight = p(weight)                                   # shared (a tied lm_head)
        self.bias = None if bias is None else p(bias)
        self.routes: list[tuple[int | None, str]] = [(None, "mkl")]
        self.prepared: dict[str, object] = {}  # backend -> its copy of the weight
        self.shape: tuple[int, int] = tuple(weight.shape)  # (out_features, in_features)

    @property
    def packed(self) -> torch.Tensor | None:
        """The oneDNN-prepacked weight, if routed there."""
        return self.prepared.get("onednn")

    def drop_dense(self) -> bool:
        """Free the dense weight of a layer whose every route has its own copy, if it owns its
        weight, after one checking call per backend; False (nothing dropped) if not, or a call
        fails (the layer falls back, logged)."""
        if self.weight is None or not self.owns_weight or any(b in DENSE for _, b in self.routes):
            return False
        for backend in {b for _, b in self.routes}:
            try:
                self.run(backend, torch.zeros(1, self.shape[1], dtype=self.weight.dtype))
            except Exception as e:  # noqa: BLE001
                self._fall_back(f"{NAMES[backend]} check call failed ({e!r})")
                return False
        self.weight = None
        return True

    def held_bytes(self) -> tuple[int, int]:
        """(dense, prepared): bytes of the dense weight (0 once dropped; counted even when it
        is shared) and of the backends' own copies (0 if none)."""
        dense = 0 if self.weight is None else self.weight.numel() * self.weight.element_size()
        prepared = 0
        for copy in self.prepared.values():
            prepared += copy.numel() * copy.element_size() if isinstance(copy, torch.Tensor) else copy.nbytes
        return dense, prepared

    def route(self, routes: list[tuple[int | None, str]], prepared: dict[str, object] | None = None) -> None:
        """Use `routes` from now on, preparing each backend's copy of the weight when a route
        first names it (unless `prepared` holds it, made by the caller); a failed preparation
        leaves the layer on F.linear (logged)."""
        unknown = {b for _, b in routes} - set(BACKENDS)
        if unknown or not routes or routes[-1][0] is not None:
            raise ValueError(f"routes {routes}: want (below, backend) pairs ending with (None, "
                             f"backend), backends among {', '.join(BACKENDS)}")
        if self.weight is None:
            raise ValueError(f"linear {self.shape}: its dense weight was dropped (drop_dense): "
                             f"it stays on {', '.join(self.prepared)}")
        wanted = {b for _, b in routes} - set(DENSE)
        if "dot" in {b for _, b in routes} and (why := linear_cpu.unavailable(self.weight)) is not None:
            self._fall_back(f"{NAMES['dot']} cannot serve ({why})")
            return
        self.prepared.update(prepared or {})
        for backend in sorted(wanted - set(self.prepared)):
            try:
                self.prepared[backend] = prepare(backend, self.weight)
            except Exception as e:  # noqa: BLE001  (any failure: F.linear serves)
                self._fall_back(f"preparing for {NAMES[backend]} failed ({e!r})")
                return
        self.routes = list(routes)
        self.prepared = {b: c for b, c in self.prepared.items() if b in wanted}

    def backend_for(self, rows: int) -> str:
        for below, backend in self.routes:
            if below is None or rows < below:
                return backend
        return self.routes[-1][1]

    def run(self, backend: str, x: torch.Tensor) -> torch.Tensor:
        """x through `backend` (the layer must be prepared for it)."""
        if backend == "mkl":
            return F.linear(x, self.weight, self.bias)
        k = x.shape[-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        if backend == "dot":
            y = linear_cpu.matmul(x2 if x2.stride(-1) == 1 else x2.contiguous(), self.weight, self.bias)
        elif backend == "onednn":
            y = onednn_linear(x2, self.prepared["onednn"], self.bias)
        elif backend == "panel":
            y = panel_cpu.matmul(x2 if x2.stride(-1) == 1 else x2.contiguous(), self.prepared["panel"], self.bias)
        elif backend == "int4":
            y = linear_int4.matmul(x2, self.prepared["int4"], self.bias)
        else:
            y = linear_int8.matmul(x2, self.prepared["int8"], self.bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a gate/up layer (its rows the gate's, then the up's) on x [M, K],
        in one pass where M goes to "dot" or "panel" (pagedserve.kernels.linear_cpu.matmul_silu,
        panel_cpu.matmul_silu: the [M, N] output is never written); None elsewhere (the caller
        multiplies, then applies it), with a bias, or with the fused ops off (PAGEDSERVE_FUSED_OPS=0)."""
        backend = self.backend_for(x.shape[0])
        if (x.dim() != 2 or x.stride(1) != 1 or self.bias is not None or not fused_cpu.fused_ops_on()
                or backend not in ("dot", "panel") or self.shape[0] % 2):
            return None
        if backend == "panel":
            return panel_cpu.matmul_silu(x, self.prepared["panel"])
        return linear_cpu.matmul_silu(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = self.backend_for(x.numel() // x.shape[-1])
        if backend == "mkl":
            return F.linear(x, self.weight, self.bias)
        try:
            return self.run(backend, x)
        except Exception as e:  # noqa: BLE001
            self._fall_back(f"{NAMES[backend]} call on {tuple(x.shape)} failed ({e!r})")
            return F.linear(x, self.weight, self.bias)

    def _fall_back(self, why: str) -> None:
        n, k = self.shape
        if self.weight is None:
            raise RuntimeError(f"linear {n}x{k}: {why}, and its dense weight was dropped")
        log.warning("linear %dx%d: %s; F.linear (mkl) from now on", n, k, why)
        self.routes, self.prepared = [(None, "mkl")], {}
