"""A decoder's linear layer: y = x @ weight.T + bias, by the backend routed for x's row count.

Linear(weight, bias) computes through F.linear ("mkl": MKL on the CPU, cuBLAS on a GPU)
until `route(routes)` says otherwise. routes is a list of (below, backend): the first entry
whose `below` exceeds the rows M of x (None: any M) names the backend. "onednn" multiplies
by a weight prepacked once for oneDNN (`torch.ops.mkldnn`, CPU). If oneDNN raises, for the
prepack or a call, the layer logs what happened and uses F.linear from then on (that call
included). `drop_dense()`, for a layer routed to oneDNN at every M that owns its weight (built from a
tensor, not from a Parameter it shares such as a tied embedding), frees the dense copy (else
the weights are held twice); its oneDNN failures then raise.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

BACKENDS = ("mkl", "onednn")

log = logging.getLogger("pagedserve.executor")


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        p = lambda t: t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.owns_weight = not isinstance(weight, nn.Parameter)  # a Parameter passed in is
        self.weight = p(weight)                                   # shared (a tied lm_head)
        self.bias = None if bias is None else p(bias)
        self.routes: list[tuple[int | None, str]] = [(None, "mkl")]
        self.packed: torch.Tensor | None = None
        self.shape: tuple[int, int] = tuple(weight.shape)  # (out_features, in_features)

    def drop_dense(self) -> bool:
        """Free the dense weight of a layer on oneDNN at every M that owns its weight, after one
        checking call; False (nothing dropped) if it is not, or the call fails (the layer falls
        back, logged)."""
        if (self.weight is None or not self.owns_weight or self.packed is None
                or any(b != "onednn" for _, b in self.routes)):
            return False
        try:
            self.run("onednn", torch.zeros(1, self.shape[1], dtype=self.weight.dtype))
        except Exception as e:  # noqa: BLE001
            self._fall_back(f"oneDNN check call failed ({e!r})")
            return False
        self.weight = None
        return True

    def held_bytes(self) -> tuple[int, int]:
        """(dense, prepared): bytes of the dense weight (0 once dropped; counted even when it
        is shared) and of the backend's own copy (the prepacked weight; 0 if none)."""
        dense = 0 if self.weight is None else self.weight.numel() * self.weight.element_size()
        prepared = 0 if self.packed is None else self.packed.numel() * self.packed.element_size()
        return dense, prepared

    def route(self, routes: list[tuple[int | None, str]]) -> None:
        """Use `routes` from now on, prepacking for oneDNN when a route names it; a failed
        prepack leaves the layer on F.linear (logged)."""
        unknown = {b for _, b in routes} - set(BACKENDS)
        if unknown or not routes or routes[-1][0] is not None:
            raise ValueError(f"routes {routes}: want (below, backend) pairs ending with (None, "
                             f"backend), backends among {', '.join(BACKENDS)}")
        if self.weight is None:
            raise ValueError(f"linear {self.shape}: its dense weight was dropped (drop_dense): "
                             "it stays on oneDNN")
        if any(b == "onednn" for _, b in routes) and self.packed is None:
            try:
                self.packed = onednn_pack(self.weight)
            except Exception as e:  # noqa: BLE001  (any oneDNN failure: F.linear serves)
                self._fall_back(f"prepacking for oneDNN failed ({e!r})")
                return
        self.routes = list(routes)
        if not any(b == "onednn" for _, b in routes):
            self.packed = None

    def backend_for(self, rows: int) -> str:
        for below, backend in self.routes:
            if below is None or rows < below:
                return backend
        return self.routes[-1][1]

    def run(self, backend: str, x: torch.Tensor) -> torch.Tensor:
        """x through `backend` (the layer must be prepacked for "onednn")."""
        if backend == "mkl":
            return F.linear(x, self.weight, self.bias)
        k = x.shape[-1]
        y = onednn_linear(x if x.dim() == 2 else x.reshape(-1, k), self.packed, self.bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        backend = self.backend_for(x.numel() // x.shape[-1])
        if backend == "mkl":
            return F.linear(x, self.weight, self.bias)
        try:
            return self.run(backend, x)
        except Exception as e:  # noqa: BLE001
            self._fall_back(f"oneDNN call on {tuple(x.shape)} failed ({e!r})")
            return F.linear(x, self.weight, self.bias)

    def _fall_back(self, why: str) -> None:
        n, k = self.shape
        if self.weight is None:
            raise RuntimeError(f"linear {n}x{k}: {why}, and its dense weight was dropped")
        log.warning("linear %dx%d: %s; F.linear (mkl) from now on", n, k, why)
        self.routes, self.packed = [(None, "mkl")], None
