"""dlion.Lion against a literal transcription of the four-line rule of "Symbolic Discovery of
Optimization Algorithms" (Chen et al. 2023, arXiv 2302.06675)."""

import io
import math

import pytest
import torch

import dlion


def reference_lion(p, g, m, lr, beta1, beta2, wd):
    """The four lines, literally."""
    p = p * (1 - lr * wd)
    c = beta1 * m + (1 - beta1) * g
    p = p - lr * torch.sign(c)
    m = beta2 * m + (1 - beta2) * g
    return p, m


def make_params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in [(7, 5), (13,), (3, 4, 2), (1,)]]


@pytest.mark.parametrize("foreach, fused", [(False, False), (True, False), (None, True)])
@pytest.mark.parametrize("wd", [0.0, 0.3])
def test_matches_literal_reference_exactly(foreach, fused, wd):
    lr, betas = 3e-3, (0.9, 0.99)
    params = make_params()
    ref_p = [p.detach().clone() for p in params]
    ref_m = [torch.zeros_like(p) for p in params]
    opt = dlion.Lion(params, lr=lr, betas=betas, weight_decay=wd, foreach=foreach, fused=fused)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        grads[0][0, :] = 0.0  # exact zeros: sign(0) = 0 must leave these coordinates alone
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        for i, gr in enumerate(grads):
            ref_p[i], ref_m[i] = reference_lion(ref_p[i], gr, ref_m[i], lr, *betas, wd)
    for p, r, m in zip(params, ref_p, ref_m):
        assert torch.equal(p.detach(), r)
        assert torch.equal(opt.state[p]["exp_avg"], m)
    # The row whose gradient is always 0 only decays: no sign ever moves it.
    row = make_params()[0].detach()[0]
    for _ in range(50):
        row = row * (1 - lr * wd)
    assert torch.equal(params[0].detach()[0], row)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fused_matches_the_multi_tensor_path_for_every_dtype_and_maximize(dtype):
    """fp64 runs the compiled loop in fp64; bf16 parameters (and a bf16-stored momentum) fall back
    to the multi-tensor path; a lr schedule changes inputs only. Values equal at every step."""
    a, b = make_params(5, dtype), make_params(5, dtype)
    kw = dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.2, maximize=True)
    oa = dlion.Lion(a, fused=True, **kw)
    ob = dlion.Lion(b, foreach=True, **kw)
    gen = torch.Generator().manual_seed(0)
    for t in range(12):
        for o in (oa, ob):
            o.param_groups[0]["lr"] = 1e-2 / (t + 1)
        for pa, pb in zip(a, b):
            g = torch.randn(pa.shape, generator=gen).to(dtype)
            pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
        for pa, pb in zip(a, b):
            assert torch.equal(pa, pb) and torch.equal(oa.state[pa]["exp_avg"], ob.state[pb]["exp_avg"])
            assert oa.state[pa]["step"] == ob.state[pb]["step"] == t + 1


def test_fused_refuses_parameters_off_the_cpu():
    p = torch.zeros(3, device="meta", requires_grad=True)
    with pytest.raises(ValueError, match="CPU parameters only"):
        dlion.Lion([p], fused=True)


def test_zero_gradient_row_never_moves_without_decay():
    p = torch.ones(4, 3, requires_grad=True)
    opt = dlion.Lion([p], lr=0.1)
    for _ in range(10):
        g = torch.randn(4, 3)
        g[2] = 0.0
        p.grad = g
        opt.step()
    assert torch.equal(p.detach()[2], torch.ones(3))


def test_foreach_and_single_tensor_paths_identical():
    a, b = make_params(3), make_params(3)
    oa = dlion.Lion(a, lr=1e-2, weight_decay=0.1, foreach=True)
    ob = dlion.Lion(b, lr=1e-2, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        for pa, pb in zip(a, b):
            g = torch.randn(pa.shape, generator=gen)
            pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)


def test_param_groups_use_their_own_hyperparameters():
    p1, p2 = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = dlion.Lion([{"params": [p1], "lr": 0.5}, {"params": [p2]}], lr=0.25)
    p1.grad = torch.tensor([1.0, -2.0, 0.0])
    p2.grad = torch.tensor([1.0, -2.0, 0.0])
    opt.step()
    assert p1.tolist() == [-0.5, 0.5, 0.0]
    assert p2.tolist() == [-0.25, 0.25, 0.0]


def test_maximize_flips_the_gradient():
    p = torch.zeros(2, requires_grad=True)
    opt = dlion.Lion([p], lr=1.0, maximize=True)
    p.grad = torch.tensor([1.0, -1.0])
    opt.step()
    assert p.tolist() == [1.0, -1.0]


def test_state_dict_round_trip_continues_identically():
    a = make_params(5)
    oa = dlion.Lion(a, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(2)
    grads = [[torch.randn(p.shape, generator=gen) for p in a] for _ in range(10)]
    for t in range(5):
        for p, g in zip(a, grads[t]):
            p.grad = g.clone()
        oa.step()
    b = [p.detach().clone().requires_grad_() for p in a]
    ob = dlion.Lion(b, lr=1.0)
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)  # through bytes, as from a checkpoint file
    buf.seek(0)
    ob.load_state_dict(torch.load(buf, weights_only=True))
    assert ob.param_groups[0]["lr"] == 1e-2
    for t in range(5, 10):
        for pa, pb, g in zip(a, b, grads[t]):
            pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)


def test_lr_scheduler_drives_the_step_size():
    p = torch.zeros(1, requires_grad=True)
    opt = dlion.Lion([p], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        p.grad = torch.tensor([-1.0])
        opt.step()
        sched.step()
    assert p.item() == 1.0 + 0.5 + 0.25


def test_closure_is_called_and_its_loss_returned():
    p = torch.tensor([2.0], requires_grad=True)
    opt = dlion.Lion([p], lr=0.5)

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 4.0
    assert p.item() == 1.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_momentum_and_math(dtype):
    p32 = torch.randn(64, generator=torch.Generator().manual_seed(0))
    p = p32.to(dtype).requires_grad_()
    opt = dlion.Lion([p], lr=0.01, weight_decay=0.5)
    m = torch.zeros(64)
    ref = p.detach().float()
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        g = torch.randn(64, generator=gen).to(dtype)
        p.grad = g
        ref, m = reference_lion(ref, g.float(), m, 0.01, 0.9, 0.99, 0.5)
        ref = ref.to(dtype).float()  # the parameter is stored in low precision after each step
        opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt.state[p]["exp_avg"], m)
    assert torch.equal(p.detach().float(), ref)


# -- bad input: clear error, nothing changed -----------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0.0), "Invalid learning rate"),
    (dict(lr=-1e-3), "Invalid learning rate"),
    (dict(betas=(1.0, 0.99)), "Invalid beta1"),
    (dict(betas=(0.9, -0.1)), "Invalid beta2"),
    (dict(betas=(0.9,)), "Invalid betas"),
    (dict(weight_decay=-0.1), "Invalid weight_decay"),
    (dict(weight_decay=math.nan), "Invalid weight_decay"),
])
def test_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dlion.Lion([torch.zeros(2, requires_grad=True)], **kwargs)


def test_bad_parameters():
    with pytest.raises(ValueError, match="dtype torch.int64; Lion needs floating-point"):
        dlion.Lion([torch.zeros(2, dtype=torch.long)])
    with pytest.raises(ValueError, match="is sparse"):
        dlion.Lion([torch.zeros(2, 2).to_sparse()])
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="appears more than once"):
        dlion.Lion([p, p])
    with pytest.raises(ValueError, match="appears more than once"):
        dlion.Lion([{"params": [p]}, {"params": [p]}])


def test_sparse_gradient_rejected_before_anything_changes():
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    opt = dlion.Lion([a, b], lr=0.1)
    a.grad = torch.ones(3)
    b.grad = torch.ones(3).to_sparse()
    with pytest.raises(ValueError, match="sparse gradient"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(3))
    assert opt.state[a] == {}


def test_load_state_dict_keeps_fp32_momentum_of_bf16_params():
    p = torch.randn(8).to(torch.bfloat16).requires_grad_()
    opt = dlion.Lion([p], lr=0.01)
    p.grad = torch.randn(8).to(torch.bfloat16)
    opt.step()
    m = opt.state[p]["exp_avg"].clone()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    q = p.detach().clone().requires_grad_()
    other = dlion.Lion([q], lr=0.01)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert other.state[q]["exp_avg"].dtype == torch.float32
    assert torch.equal(other.state[q]["exp_avg"], m)


# -- momentum_dtype: bf16 storage, fp32 math --------------------------------------

@pytest.mark.parametrize("foreach", [False, True])
def test_bf16_momentum_is_the_fp32_rule_with_m_rounded_once_per_step(foreach):
    lr, betas, wd = 3e-3, (0.9, 0.99), 0.1
    params = make_params()
    ref_p = [p.detach().clone() for p in params]
    ref_m = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
    opt = dlion.Lion(params, lr=lr, betas=betas, weight_decay=wd, foreach=foreach, momentum_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        for i, gr in enumerate(grads):
            ref_p[i], m32 = reference_lion(ref_p[i], gr, ref_m[i].float(), lr, *betas, wd)
            ref_m[i] = m32.to(torch.bfloat16)  # round to nearest, once
    for p, r, m in zip(params, ref_p, ref_m):
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(p.detach(), r)
        assert torch.equal(opt.state[p]["exp_avg"], m)
    # half the state memory of fp32 momenta
    state_bytes = sum(opt.state[p]["exp_avg"].numel() * opt.state[p]["exp_avg"].element_size() for p in params)
    assert state_bytes == 2 * sum(p.numel() for p in params)


def test_bf16_momentum_survives_a_state_dict_round_trip():
    p = torch.randn(8, requires_grad=True)
    opt = dlion.Lion([p], lr=0.01, momentum_dtype=torch.bfloat16)
    p.grad = torch.randn(8)
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    q = p.detach().clone().requires_grad_()
    other = dlion.Lion([q], lr=0.01, momentum_dtype=torch.bfloat16)
    other.load_state_dict(torch.load(buf, weights_only=True))  # torch.optim would cast it to fp32
    assert other.state[q]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(other.state[q]["exp_avg"], opt.state[p]["exp_avg"])


@pytest.mark.parametrize("bad", [torch.int8, "bf16", torch.bool])
def test_bad_momentum_dtype(bad):
    with pytest.raises(ValueError, match="momentum_dtype must be None or a floating-point torch.dtype"):
        dlion.Lion([torch.zeros(2, requires_grad=True)], momentum_dtype=bad)


def test_lion_accepts_named_parameters_like_torch_optim():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = dlion.Lion(model.named_parameters(), lr=0.1)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    opt2 = dlion.Lion([{"params": list(model.named_parameters()), "lr": 0.2}])
    assert opt2.param_groups[0]["param_names"] == ["weight", "bias"] and opt2.param_groups[0]["lr"] == 0.2
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]
