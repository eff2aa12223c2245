"""Throughput maths alone: a fake clock and hand-computed expectations."""
import pytest
import torch

from shardscope.measure.throughput import FlopsModel, ThroughputWindow, WindowTotals, batch_counts, rates
from shardscope.units import peak_flops


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def tick(self, seconds):
        self.now += seconds


def timed_step(window, clock, seconds, pause_after=False):
    window.step_begin()
    clock.tick(seconds)
    window.step_end(pause_after=pause_after)


def padded_batch(lengths, width):
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return {"input_ids": torch.ones(len(lengths), width, dtype=torch.long), "attention_mask": mask}


def test_tokens_exclude_padding():
    samples, tokens, seq_len = batch_counts((), padded_batch([3, 5, 8], width=8))
    assert (samples, int(tokens), seq_len) == (3, 16, 8)


def test_tokens_without_mask_count_every_position():
    samples, tokens, seq_len = batch_counts((torch.ones(2, 7, dtype=torch.long),), {})
    assert (samples, tokens, seq_len) == (2, 14, 7)


def test_vision_tokens_are_patches_plus_cls():
    samples, tokens, seq_len = batch_counts((), {"pixel_values": torch.zeros(4, 3, 28, 28)}, patch_size=14)
    assert (samples, tokens, seq_len) == (4, 4 * 5, 5)
    assert batch_counts((), {"pixel_values": torch.zeros(4, 3, 28, 28)})[1] is None


@pytest.mark.parametrize("accumulation", [1, 4])
def test_window_rates_under_gradient_accumulation(accumulation):
    clock = FakeClock()
    window = ThroughputWindow(clock)
    flops = FlopsModel(trainable_params=1000, frozen_params=0, n_layers=2, d_attn=8)
    for _step in range(3):
        window.step_begin()
        for _micro in range(accumulation):
            samples, tokens, seq_len = batch_counts((), padded_batch([4, 2], width=4))
            window.add_batch(samples, tokens, tokens * flops.per_token(seq_len))
            clock.tick(0.5)
        window.step_end()
    totals = window.totals()
    assert totals.samples == 3 * accumulation * 2
    assert int(totals.tokens) == 3 * accumulation * 6
    assert totals.seconds == pytest.approx(3 * accumulation * 0.5)
    per_token = 6 * 1000 + 12 * 2 * 8 * 4
    assert float(totals.flops) == pytest.approx(3 * accumulation * 6 * per_token)
    got = rates(WindowTotals(totals.samples, float(totals.tokens), float(totals.flops), totals.seconds), peak=None)
    assert got["samples_per_s"] == pytest.approx(2 / 0.5)
    assert got["tokens_per_s"] == pytest.approx(6 / 0.5)
    assert got["tflops_per_device"] == pytest.approx(6 * per_token / 0.5 / 1e12)
    assert got["mfu"] is None


def test_uneven_last_batch_counts_real_samples():
    clock = FakeClock()
    window = ThroughputWindow(clock)
    for lengths in ([5, 5, 5, 5], [5, 5, 5, 5], [5]):  # 9 samples, the last batch short
        window.step_begin()
        window.add_batch(*batch_counts((), padded_batch(lengths, width=5))[:2])
        clock.tick(1.0)
        window.step_end()
    totals = window.totals()
    assert (totals.samples, int(totals.tokens), totals.seconds) == (9, 45, 3.0)


def test_evaluation_gap_is_excluded_and_data_loading_is_not():
    clock = FakeClock()
    window = ThroughputWindow(clock)
    timed_step(window, clock, 1.0)
    clock.tick(0.25)  # data loading for the next step: counted
    timed_step(window, clock, 1.0, pause_after=True)
    clock.tick(30.0)  # evaluation and checkpointing: not counted
    timed_step(window, clock, 1.0)
    assert window.totals().seconds == pytest.approx(3.25)


def test_reset_starts_a_new_window_without_losing_the_anchor():
    clock = FakeClock()
    window = ThroughputWindow(clock)
    timed_step(window, clock, 2.0)
    window.reset()
    clock.tick(1.0)  # the gap since the last step still belongs to the next one
    timed_step(window, clock, 1.0)
    assert window.totals().seconds == pytest.approx(2.0)


def test_frozen_parameters_cost_four_flops_not_six():
    lora = FlopsModel(trainable_params=10, frozen_params=1000, n_layers=0, d_attn=0)
    assert lora.per_token(seq_len=128) == 6 * 10 + 4 * 1000


def test_mfu_uses_dense_peak_and_is_omitted_when_unknown():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.5e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5e12)
    assert peak_flops("Tesla V100-SXM2-32GB", "bf16") is None  # V100 has no bf16 tensor cores
    assert peak_flops("Some Future GPU", "bf16") is None
    assert peak_flops("Some Future GPU", "bf16", overrides={"future": {"bf16": 100.0}}) == pytest.approx(100e12)
    half = rates(WindowTotals(1, 1, 494.7e12, 1.0), peak=peak_flops("NVIDIA H100 80GB HBM3", "bf16"))
    assert half["mfu"] == pytest.approx(0.5)


@pytest.mark.parametrize("durations", [[0.5], [0.3, 0.1], [0.2, 0.9, 0.4, 0.4, 1.3, 0.25, 0.7]])
def test_step_time_is_the_median_and_deciles_of_the_counted_steps(durations):
    """Each counted step's time, as numpy's percentiles (linear interpolation) would put them; a step left out of the
    count (instrumented) or after a pause's gap is not among them."""
    import numpy

    from shardscope.measure.throughput import step_time_summary

    clock = FakeClock()
    window = ThroughputWindow(clock)
    for seconds in durations:
        timed_step(window, clock, seconds)
        window.step_begin()
        clock.tick(7.0)  # an instrumented step: not counted
        window.step_end(count=False, pause_after=True)
        clock.tick(11.0)  # an evaluation after it: not timed
    summary = step_time_summary(window.durations)
    expected = numpy.percentile(durations, [50, 10, 90])
    assert [summary[k] for k in ("median", "p10", "p90")] == pytest.approx(list(expected), rel=1e-12)
    assert summary["steps"] == len(durations) and window.seconds == pytest.approx(sum(durations))


def test_step_time_of_no_counted_step_is_none():
    from shardscope.measure.throughput import step_time_summary

    assert step_time_summary([]) == {"median": None, "p10": None, "p90": None, "steps": 0}
