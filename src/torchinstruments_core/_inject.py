"""``inject_observer`` and ``remove_observer``: the two calls a user needs."""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

from torch import nn

from torchinstruments_core._config import (
    ErrorPolicy,
    RankPolicy,
    check_exclusive,
    check_instance,
    check_positive_int,
    check_run_id,
    parse_choice,
)
from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core._layers import DEFAULT_MAX_FOCUS_LAYERS, focus_arguments, select_layers
from torchinstruments_core._measure import Measurer
from torchinstruments_core._observer import Observer, ObserverConfig
from torchinstruments_core._optimizer_probe import (
    DEFAULT_STEP_SIGNALS,
    check_optimizers,
    parse_step_signals,
)
from torchinstruments_core._registry import claim, lookup
from torchinstruments_core.reducers import HistogramReducer, Reducer, default_reducers
from torchinstruments_core.reducers.histogram import MAX_HISTOGRAM_BINS
from torchinstruments_core.samplers import IntervalSampler, Sampler
from torchinstruments_core.selectors import SelectorFn, leaf_modules

if TYPE_CHECKING:
    import os
    from collections.abc import Sequence

    import torch

    from torchinstruments_core.sinks import Sink

DEFAULT_INTERVAL_SECONDS = 60.0
DEFAULT_OUTPUT_DIR = "telemetry"


def inject_observer(
    model: nn.Module,
    *,
    interval: float | None = None,
    sampler: Sampler | None = None,
    selector: SelectorFn | None = None,
    reducers: Sequence[Reducer] | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    sink: Sink | None = None,
    focus_selector: SelectorFn | None = None,
    max_focus_layers: int = DEFAULT_MAX_FOCUS_LAYERS,
    histogram_bins: int = 64,
    rank_policy: str = "rank0",
    error_policy: str = "warn",
    capture_direct_forwards: bool = False,
    run_id: str | None = None,
    first_sample_id: int = 0,
    histogram_selector: SelectorFn | None = None,
    max_histogram_modules: int | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    step_signals: Sequence[str] = DEFAULT_STEP_SIGNALS,
    record_inputs: bool = False,
    profile: bool = False,
    background_reductions: bool | None = None,
) -> Observer:
    """Observe ``model``: sampled statistics of its modules' outputs and output gradients.

    The model is never changed: no parameter, buffer or module is added, outputs and gradients are
    bit-identical, and ``remove_observer`` leaves no hook behind. On a forward that is not sampled
    only two hooks on the root run; no per-module hook, no reducer.

    A ``torch.compile``d model is best observed as the compiled module
    (``inject_observer(torch.compile(model))``): unsampled forwards run its graph untouched, and
    a sampled forward runs the model's own Python (the ``force_eager`` stance, torch 2.6 and
    later), so it is never recompiled for the hooks. The hooks are never traced into a graph.

    Args:
        model: The root module. A sample is one call of it (and the backward through its graph).
        interval: Seconds between samples: the first root forward, then the first after each
            interval (default 60). Not together with ``sampler``.
        sampler: Which root forwards are sampled, e.g. ``EveryNForwardsSampler(100)``.
        selector: ``(name, module) -> bool`` choosing the observed modules (default
            ``leaf_modules()``). Names are the model's own, without wrapper attributes.
        reducers: Scalar reducers (default ``default_reducers()``, whose metrics are
            ``reducers.DEFAULT_METRICS``: mean, std, min, max, zero_fraction,
            nonfinite_fraction, rms, max_abs, l2_norm, p25, p50, p75). Add
            ``precision_reducers()`` for kurtosis and the fp8/fp16/bf16 range fractions.
        output_dir: Folder of the run directory (default ``"telemetry"``). Not together with
            ``sink``. Checked now: made absolute (a later ``os.chdir`` does not move it), created
            and probed for writing; it must hold no run, no file a run writes, no link in their
            place, and no other observer of this process may write it.
        sink: Where finished samples go instead of a run directory, e.g. ``RecordingSink()``.
        focus_selector: Chooses the focus layers among the observed modules: their tensors also
            get histograms, and an adapter routes their scalars (default: up to
            ``max_focus_layers`` observed modules with parameters of their own, spread over
            depth, the largest always included; parameter-free ones, never ``Flatten``,
            ``Identity``, dropout or pooling, only when too few have parameters).
        max_focus_layers: At most this many focus layers (0 turns histograms off).
        histogram_bins: Bins of each histogram, spanning the tensor's finite range; at most
            ``MAX_HISTOGRAM_BINS`` (65,536).
        rank_policy: ``"rank0"`` observes only global rank 0; ``"all"`` observes every rank.
        error_policy: ``"warn"``: a failing reducer or sink warns once and training goes on, the
            values recorded as unavailable; ``"raise"``: raise ``ObservationError``.
        capture_direct_forwards: Also observe ``module.forward(x)`` calls that bypass
            ``module(x)``, by patching ``forward`` on the instances (removal restores it). Costs a
            Python call per observed module on every forward.
        run_id: Identifier written with every row, a non-empty str; pass the same one on every
            rank to group a distributed run (default: generated from the time and a random
            suffix, per process).
        first_sample_id: The first sample's id; a resumed run passes the number of samples it
            had taken, so that ids continue.
        histogram_selector: Deprecated name of ``focus_selector`` (warns).
        max_histogram_modules: Deprecated name of ``max_focus_layers`` (warns).
        optimizer: An optimizer, or several, whose steps give the optimizer step signals
            (``Observer.watch_optimizer`` for each): the parameters, their gradients as the
            optimizer uses them, their updates and the optimizer's state, in a step record per
            optimizer step after a sampled forward.
        step_signals: Which optimizer step signals are recorded (default all:
            ``"parameter"``, ``"parameter_gradient"``, ``"update"``, ``"optimizer_state"``).
            Leave out ``"update"`` to save its memory: one copy of the observed parameters,
            held during a recorded optimizer step only.
        record_inputs: Also measure each observed call's input tensors, positional and keyword
            (signal ``input``, ``tensor_path`` ``input.0``, ``input.x``), and the gradients
            flowing back into those that take one (``input_gradient``). Arms a forward
            pre-hook per observed module in sampled forwards only.
        profile: Also record each observed call's forward and backward time (signal ``time``,
            metric ``ms``) and, on CUDA, its allocated-memory change and peak (``memory``),
            inclusive of the modules it calls. CUDA times are events read once the sample's
            values have reached the host: nothing waits for the device. On CUDA it resets the
            allocator's peak statistic (``torch.cuda.reset_peak_memory_stats``) at every call
            boundary of a sampled step, so ``torch.cuda.max_memory_allocated()`` read after a
            sampled step covers only its end (see the README).
        background_reductions: On the CPU, reduce each sampled tensor on a worker thread
            while the model computes, from a copy taken in the hook (a gradient, which autograd
            only reads, or an output that an earlier forward left unchanged, from the tensor
            itself): ``None`` (default) where torch's intra-op threads leave a core free
            (``torch.get_num_threads()`` below the cores this process may use, read at each
            sample's first tensor), except after a small sample (at most 512 Ki CPU entries
            measured from its start to the next sample's, whose reductions are mostly Python
            the worker cannot overlap with the model: the next sample is reduced in the
            hooks); ``True`` always, ``False`` never.
            The values are the same either way, but for a tensor read without a copy that the
            model's code changes in place before that was checked (at the thread's next hook,
            or when the sample closes): that sample has no values for it
            (``modified_in_place``), and it is copied from then on. A write that bypasses
            torch's in-place operators (``.data``, a numpy view) is not seen. The tensors
            waiting for the worker hold at most the largest one so far (in float32) or 8 MiB,
            whichever is more; up to 8 MiB of reduced copies' buffers is kept for reuse until
            the observer is removed. A sample is delivered once the worker has reduced it.
            Under ``error_policy="raise"`` it is off, so a failure raises where it happens.

    Returns:
        The attached ``Observer``; also a context manager that removes itself. Left attached,
        it is removed (its samples delivered, its run finalized) when the process ends normally,
        a ``multiprocessing`` child included, or receives SIGTERM; in a child made by ``fork`` it
        is inert. Forwards that run at once in several threads are separate samples.

    Raises:
        ObserverAlreadyAttachedError: ``model`` already has an observer.
        ConfigurationError: An argument is invalid (a ``ValueError``), such as a class given
            where an instance is expected, or an ``output_dir`` that cannot be created or written.
        RunDirectoryExistsError: ``output_dir`` holds a run or a file a run writes, or another
            observer of this process writes it.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchinstruments_core import AlwaysSampler, inject_observer
        >>> from torchinstruments_core.testing import RecordingSink
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> sink = RecordingSink()
        >>> with inject_observer(model, sampler=AlwaysSampler(), sink=sink):
        ...     model(torch.randn(16, 4)).sum().backward()
        >>> sink.value("0", "output", "std") > 0
        True
        >>> sink.value("2", "output_gradient", "mean")
        1.0
    """
    if not isinstance(model, nn.Module):
        raise ConfigurationError.invalid("model", type(model).__name__, "a torch.nn.Module")
    focus = focus_arguments(
        "inject_observer",
        focus_selector,
        max_focus_layers,
        histogram_selector,
        max_histogram_modules,
    )
    bins = check_positive_int(
        "histogram_bins", histogram_bins, minimum=1, maximum=MAX_HISTOGRAM_BINS
    )
    layers = select_layers(model, _selector(selector), *focus)
    checked_sampler = _build_sampler(interval, sampler)
    policies = (
        parse_choice(RankPolicy, "rank_policy", rank_policy),
        parse_choice(ErrorPolicy, "error_policy", error_policy),
    )
    measurer = Measurer(
        _check_reducers(reducers),
        HistogramReducer(bins=bins),
        background=_background(background_reductions, policies[1]),
    )
    first_id = check_positive_int("first_sample_id", first_sample_id, minimum=0)
    optimizers = () if optimizer is None else check_optimizers(optimizer)
    signals = parse_step_signals(step_signals)
    checked_run_id = check_run_id(run_id) or new_run_id()
    built_sink = _build_sink(output_dir, sink)  # last: it creates and claims the folder
    config = ObserverConfig(
        layers=layers,
        sampler=checked_sampler,
        measurer=measurer,
        sink=built_sink,
        rank_policy=policies[0],
        error_policy=policies[1],
        capture_direct_forwards=bool(capture_direct_forwards),
        run_id=checked_run_id,
        first_sample_id=first_id,
        step_signals=signals,
        record_inputs=bool(record_inputs),
        profile=bool(profile),
    )
    observer = Observer(model, config)
    try:
        claim(model, observer)
    except BaseException:
        if sink is None:
            built_sink.close()  # never opened: it only gives its folder back
        raise
    try:
        observer._attach()
        for each in optimizers:
            observer.watch_optimizer(each)
    except BaseException:
        observer.remove()
        raise
    return observer


def remove_observer(target: nn.Module | Observer) -> None:
    """Remove the observer of a model (or the given observer). Does nothing if there is none."""
    observer = lookup(target) if isinstance(target, nn.Module) else target
    if observer is not None:
        observer.remove()


def _build_sampler(interval: float | None, sampler: Sampler | None) -> Sampler:
    check_exclusive(interval=interval, sampler=sampler)
    if sampler is None:
        return IntervalSampler(DEFAULT_INTERVAL_SECONDS if interval is None else interval)
    check_instance("sampler", sampler)
    if not callable(getattr(sampler, "should_sample", None)):
        raise ConfigurationError.invalid("sampler", sampler, "an object with should_sample(index)")
    return sampler


def _build_sink(output_dir: str | os.PathLike[str] | None, sink: Sink | None) -> Sink:
    check_exclusive(output_dir=output_dir, sink=sink)
    if sink is not None:
        check_instance("sink", sink)
        for method in ("open", "write", "close"):
            if not callable(getattr(sink, method, None)):
                raise ConfigurationError.invalid("sink", sink, "an object with open, write, close")
        return sink
    from torchinstruments_core.run_directory import RunDirectorySink

    return RunDirectorySink(DEFAULT_OUTPUT_DIR if output_dir is None else output_dir)


def _check_reducers(reducers: Sequence[Reducer] | None) -> tuple[Reducer, ...]:
    if reducers is None:
        return default_reducers()
    checked = tuple(reducers)
    for reducer in checked:
        check_instance("reducers", reducer)
        if not isinstance(getattr(reducer, "metrics", None), tuple) or not callable(
            getattr(reducer, "reduce", None)
        ):
            raise ConfigurationError.invalid(
                "reducers", reducer, "reducers with metrics and reduce"
            )
    names = [m for r in checked for m in r.metrics]
    if len(names) != len(set(names)):
        raise ConfigurationError.invalid("reducers", names, "reducers with distinct metric names")
    return checked


def new_run_id() -> str:
    """A run id from the local time and a random suffix: ``20261129-214253-9f3f7c``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def _selector(selector: SelectorFn | None) -> SelectorFn:
    if selector is None:
        return leaf_modules()
    if not callable(selector):
        raise ConfigurationError.invalid("selector", selector, "a (name, module) -> bool callable")
    return selector


def _background(choice: bool | None, error_policy: ErrorPolicy) -> bool | None:
    """``background_reductions`` checked: ``False`` under ``error_policy="raise"``."""
    if choice is not None and not isinstance(choice, bool):
        raise ConfigurationError.invalid("background_reductions", choice, "None, True or False")
    return False if error_policy is ErrorPolicy.RAISE else choice
