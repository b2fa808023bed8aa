"""Throughput and MFU: FLOPs counted as torch counts them, and a count that changes nothing."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg


def test_a_linear_layers_step_is_its_matrix_multiplies():
    # Forward x @ W.T and backward dW, each 2 * batch * in * out FLOPs; the bias adds none.
    layer = torch.nn.Linear(8, 4)
    assert sg.step_flops(layer, torch.ones(16, 8)) == 2 * 2 * 16 * 8 * 4
    # An input that needs its gradient adds dX, a third.
    assert sg.step_flops(layer, torch.ones(16, 8, requires_grad=True)) == 3 * 2 * 16 * 8 * 4


def test_counting_leaves_gradients_buffers_and_random_streams_as_they_were():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Dropout())
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    flops = sg.step_flops(model, torch.randn(4, 3), lambda m, b: m(b).square().mean())
    torch.manual_seed(1)  # the batch above drew from the stream: compare what follows a reseed
    assert flops > 0
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 7.0))
    assert model[0].bias.grad is None
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # running statistics put back
    assert torch.equal(torch.rand(3), expected)


def test_dropout_inside_the_count_does_not_move_the_training_stream():
    model = torch.nn.Dropout()
    torch.manual_seed(3)
    batch = torch.ones(2, 4, requires_grad=True)
    sg.step_flops(model, batch)
    after_count = torch.rand(2)
    torch.manual_seed(3)
    torch.ones(2, 4, requires_grad=True)
    assert torch.equal(torch.rand(2), after_count)


def test_rates_divide_by_the_time_and_the_peak():
    step = sg.rates(flops=3 * 10**12, tokens=6000, seconds=2.0, peak=5 * 10**12)
    assert step == sg.Rates(tokens_per_second=3000.0, flops_per_second=1.5e12, mfu=0.3)
    assert str(step) == "3,000 tokens/s, MFU 30.0%"
    assert str(sg.rates(flops=1, tokens=10, seconds=1.0)) == "10 tokens/s, MFU n/a"


def test_a_known_gpus_peak_and_none_on_the_cpu():
    assert sg.peak_flops("cpu") is None
    assert sg.throughput.peak_of("NVIDIA H200") == 989e12
    assert sg.throughput.peak_of("NVIDIA H100 PCIe") == 756e12  # the specific name first
    assert sg.peak_flops("cpu", torch.bfloat16) is None


@pytest.mark.cuda
def test_the_peak_of_this_gpu_is_known_or_none():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    peak = sg.peak_flops("cuda:0")
    name = torch.cuda.get_device_name(0)
    assert peak == sg.throughput.peak_of(name)
