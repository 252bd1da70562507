"""The chunk form's backward, formula by formula, in plain float64 PyTorch (the math the Triton
backward in ``rtcompile/kernels/chunk_backward*.py`` implements; written out in docs/design.md),
checked against autograd of the token-loop reference. One (sequence, head); T = 11 with C = 4, so
the last chunk is partial."""

from __future__ import annotations

import pytest
import torch

from rtcompile.kernels.reference import running_tensor_recurrent_ref

dt = torch.float64
T, V, C, s = 11, 4, 4, 0.7


def kron_rows(xs):
    out = xs[0]
    for x in xs[1:]:
        out = (out[:, :, None] * x[:, None, :]).reshape(out.shape[0], -1)
    return out


def norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def chunk_fwd(qf, kf, v, g, b, S0):
    # qf,kf lists of [T, d]; v [T,V]; g,b [T]; returns O, S_T, and per-chunk saved
    Tn = v.shape[0]
    S = S0.clone()
    outs = []
    saved = []
    for c0 in range(0, Tn, C):
        n = min(C, Tn - c0)
        pad = C - n
        P_ = lambda x: torch.cat([x[c0 : c0 + n], x.new_zeros((pad,) + x.shape[1:])])
        Qf = [P_(x) for x in qf]
        Kf = [P_(x) for x in kf]
        Vc = P_(v)
        gc = P_(g)
        bc = P_(b)
        Q = kron_rows(Qf)
        K = kron_rows(Kf)
        c = torch.cumsum(gc, 0)
        Gam = torch.exp(c)
        gam = torch.exp(c[-1])
        Dm = torch.tril(torch.exp(c[:, None] - c[None, :]))
        Gk = torch.ones(C, C, dtype=dt)
        Gq = torch.ones(C, C, dtype=dt)
        for Qx, Kx in zip(Qf, Kf):
            Gk = Gk * (Kx @ Kx.T)
            Gq = Gq * (Qx @ Kx.T)
        A = torch.tril(bc[:, None] * Gk * Dm, -1)
        Tm = torch.linalg.inv(torch.eye(C, dtype=dt) + A)
        R = Vc - Gam[:, None] * (K @ S)
        U = Tm @ (bc[:, None] * R)
        P = Gq * Dm
        O = s * (Gam[:, None] * (Q @ S) + P @ U)
        r = torch.exp(c[-1] - c)
        saved.append(
            dict(
                Qf=Qf,
                Kf=Kf,
                Q=Q,
                K=K,
                V=Vc,
                c=c,
                Gam=Gam,
                gam=gam,
                D=Dm,
                Gk=Gk,
                Gq=Gq,
                A=A,
                T=Tm,
                R=R,
                U=U,
                P=P,
                r=r,
                S=S.clone(),
                b=bc,
                n=n,
            )
        )
        S = gam * S + K.T @ (r[:, None] * U)
        outs.append(O[:n])
    return torch.cat(outs), S, saved


def factor_grads(dphi, xs):
    # dphi [C, K] for phi = kron(xs rows); returns list of [C, d_f]
    ds = [x.shape[1] for x in xs]
    Cn = dphi.shape[0]
    t = dphi.reshape(Cn, *ds)
    out = []
    for f in range(len(xs)):
        y = t
        for f2 in reversed(range(len(xs))):
            if f2 == f:
                continue
            shape = [Cn] + [1] * len(ds)
            shape[1 + f2] = ds[f2]
            y = y * xs[f2].reshape(shape)
        others = [1 + i for i in range(len(ds)) if i != f]
        out.append(y.sum(dim=others) if others else y)  # sum(dim=[]) would sum everything
    return out


def chunk_bwd(saved, dO_full, dST, nf, widths):
    dS = dST.clone()
    grads = []
    for ci in reversed(range(len(saved))):
        z = saved[ci]
        n = z["n"]
        c0 = ci * C
        dO = torch.zeros(C, V, dtype=dt)
        dO[:n] = dO_full[c0 : c0 + n]
        S = z["S"]
        dSp = dS
        Q, K, U, P, Tm, R, D, Gam, gam, r, b = (
            z["Q"],
            z["K"],
            z["U"],
            z["P"],
            z["T"],
            z["R"],
            z["D"],
            z["Gam"],
            z["gam"],
            z["r"],
            z["b"],
        )
        dU = s * P.T @ dO + r[:, None] * (K @ dSp)
        dRp = Tm.T @ dU
        dR = b[:, None] * dRp
        dSin = s * Q.T @ (Gam[:, None] * dO) + gam * dSp - K.T @ (Gam[:, None] * dR)
        dV = dR
        dT = dU @ (R.T * b[None, :])
        dA = torch.tril(-(Tm.T @ dT @ Tm.T), -1)
        db = (dRp * R).sum(1) + (dA * z["Gk"] * D).sum(1)
        dGk = dA * b[:, None] * D
        dP = torch.tril(s * dO @ U.T)
        dGq = dP * D
        dD = dA * b[:, None] * z["Gk"] + dP * z["Gq"]
        E = torch.tril(dD * D)
        dc = E.sum(1) - E.sum(0)
        dKphi = r[:, None] * (U @ dSp.T) - Gam[:, None] * (dR @ S.T)
        dQphi = s * Gam[:, None] * (dO @ S.T)
        KdS = K @ dSp
        dc = dc + s * Gam * (dO * (Q @ S)).sum(1) - Gam * (dR * (K @ S)).sum(1) - r * (U * KdS).sum(1)
        dc[-1] = dc[-1] + (r * (U * KdS).sum(1)).sum() + gam * (S * dSp).sum()
        Qf, Kf = z["Qf"], z["Kf"]
        dQf = factor_grads(dQphi, Qf)
        dKf = factor_grads(dKphi, Kf)
        G = [Kx @ Kx.T for Kx in Kf]
        Hh = [Qx @ Kx.T for Qx, Kx in zip(Qf, Kf)]
        for f in range(nf):
            dG = dGk.clone()
            dH = dGq.clone()
            for f2 in range(nf):
                if f2 != f:
                    dG = dG * G[f2]
                    dH = dH * Hh[f2]
            dKf[f] = dKf[f] + (dG + dG.T) @ Kf[f] + dH.T @ Qf[f]
            dQf[f] = dQf[f] + dH @ Kf[f]
        dg = torch.flip(torch.cumsum(torch.flip(dc, [0]), 0), [0])
        grads.append(
            dict(dQf=[x[:n] for x in dQf], dKf=[x[:n] for x in dKf], dV=dV[:n], dg=dg[:n], db=db[:n])
        )
        dS = dSin
    grads = grads[::-1]
    cat = lambda key, i=None: torch.cat([gg[key] if i is None else gg[key][i] for gg in grads])
    return (
        [cat("dQf", f) for f in range(nf)],
        [cat("dKf", f) for f in range(nf)],
        cat("dV"),
        cat("dg"),
        cat("db"),
        dS,
    )


def l2norm_backward(x, dxh):
    rho = torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    xh = x * rho
    return rho * (dxh - xh * (xh * dxh).sum(-1, keepdim=True))


@pytest.mark.parametrize("widths", [(3,), (2, 3), (2, 2, 2)], ids=lambda w: "x".join(map(str, w)))
def test_chunk_backward_formulas_match_autograd(widths):
    torch.manual_seed(0)
    q = [torch.randn(T, w, dtype=dt, requires_grad=True) for w in widths]
    k = [torch.randn(T, w, dtype=dt, requires_grad=True) for w in widths]
    v = torch.randn(T, V, dtype=dt, requires_grad=True)
    g = (-torch.rand(T, dtype=dt) * 0.5).requires_grad_(True)
    b = torch.rand(T, dtype=dt).requires_grad_(True)
    S0 = torch.randn(*widths, V, dtype=dt, requires_grad=True)
    dO, dST = torch.randn(T, V, dtype=dt), torch.randn(*widths, V, dtype=dt)
    o_ref, s_ref = running_tensor_recurrent_ref(
        [x[None, :, None] for x in q],
        [x[None, :, None] for x in k],
        v[None, :, None],
        g[None, :, None],
        b[None, :, None],
        scale=s,
        initial_state=S0[None, None],
        output_final_state=True,
        l2norm=True,
    )
    loss = (o_ref[0, :, 0] * dO).sum() + (s_ref[0, 0] * dST).sum()
    expected = torch.autograd.grad(loss, [*q, *k, v, g, b, S0])
    qn, kn = [norm(x.detach()) for x in q], [norm(x.detach()) for x in k]
    O, ST, saved = chunk_fwd(qn, kn, v.detach(), g.detach(), b.detach(), S0.detach().reshape(-1, V))
    torch.testing.assert_close(O, o_ref[0, :, 0].detach(), rtol=0, atol=1e-12)
    dQ, dK, dV, dg, db, dS0 = chunk_bwd(saved, dO, dST.reshape(-1, V), len(widths), widths)
    got = [l2norm_backward(x.detach(), d) for x, d in zip(q, dQ)]
    got += [l2norm_backward(x.detach(), d) for x, d in zip(k, dK)] + [dV, dg, db, dS0.reshape(*widths, V)]
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-10)
