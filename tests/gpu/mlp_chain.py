"""The MLP chain the persistent decode kernels compute (engines/kernels/persistent_mlp.py, tma_mlp.py): seeded
weights and its float64 reference with the kernels' rounding points (BF16 after each product, the norm and the
residual add)."""

from __future__ import annotations

import torch

EPS = 1e-6


def reference(resid, norms, wgu, wd):
    """(resid, h) after every layer of the chain, in float64 rounded where the kernels round."""
    bf = resid.dtype
    i = wgu.shape[1] // 2
    r = resid.clone()

    def norm(x, w):
        xd = x.double()
        return (w.double() * (xd * torch.rsqrt((xd * xd).mean(-1, keepdim=True) + EPS)).to(bf).double()).to(bf)

    h = norm(r, norms[0])
    for li in range(wgu.shape[0]):
        g = (h.double() @ wgu[li, :i].double().T).to(bf).double()
        u = (h.double() @ wgu[li, i:].double().T).to(bf).double()
        act = ((g * torch.sigmoid(g)).to(bf).double() * u).to(bf)
        r = (r.double() + (act.double() @ wd[li].double().T).to(bf).double()).to(bf)
        h = norm(r, norms[li])
    return r, h


def weights(layers, h, i, seed):
    """(norms [L, H], wgu [L, 2I, H], wd [L, H, I]) in BF16 on the GPU, scaled like a trained layer's."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    wgu = (torch.randn(layers, 2 * i, h, device="cuda", generator=g) * h ** -0.5).to(bf)
    wd = (torch.randn(layers, h, i, device="cuda", generator=g) * i ** -0.5).to(bf)
    norms = (1 + torch.rand(layers, h, device="cuda", generator=g)).to(bf)
    return norms, wgu, wd
