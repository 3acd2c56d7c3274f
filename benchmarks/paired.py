"""The overhead targets, measured step against step in one process: unsampled and sampled steps.

    uv run python benchmarks/paired.py [--workload all|extra|mlp|cnn|...]
        [--rounds 40] [--warmup 3] [--warmup-seconds 3] [--compile] [--exact-quartiles]
        [--sink run-directory|recording] [--device cpu|cuda] [--no-memory] [--optimizer]
        [--step-signals parameter,update]
        [--record-inputs] [--profile] [--background auto|on|off]

``overhead.py`` gives every configuration a fresh process, which is right for memory and for
comparing tools, but on a shared machine the speed of two processes can differ by 10 %, more
than the 1 % an unsampled step may cost. Here two copies of the same workload (same seed, same
weights, same batches) live in one process: one plain, one observed (default profile, run
directory). Each round runs one step of each configuration: plain, observed but not sampled,
observed and sampled followed at once by the observed model's next (unsampled) step, in an
order that rotates every round, so that drift and what a step leaves behind (caches) fall on
every configuration alike. The rounds are timed after a warm-up of ``--warmup`` rounds and at
least ``--warmup-seconds`` (``_warmup``: the run directory's writer process starts meanwhile). What a sample leaves for after its step (the run directory's writer
starts on it once the step is over) falls on the step after it, which is timed as its own
configuration and counted in the every-50 figure. Step time is wall
time (``time.perf_counter``): what the training loop waits, including any wait for the GIL
(the reduction worker's; the run directory's writer runs in a process of its own, so what it
costs the training thread is pickling each sample and sharing the cores).

``--workload all`` (the default) measures every workload of the targets that runs on the device
(on the CPU: MLP, CNN, the reference transformer and the small GPT), one after the other, and
prints one table; ``--workload extra`` measures the models of other shapes
(``_extra_workloads``: a CIFAR ResNet-20, an LSTM, a Hugging Face GPT-2 with random weights, an
MNIST-sized MLP, LeNet-5 and a MobileNet-style CNN) the same way. With ``--compile`` both copies are ``torch.compile``d (inductor) and the observed one is
observed as ``inject_observer(torch.compile(model))``. With ``--device cuda`` every step ends
with ``torch.cuda.synchronize()``, so a step's time includes its kernels, and memory comes from
the CUDA allocator's own peak statistic.

On the CPU the observed copy reduces on the reduction worker where torch's threads leave a
core free (``--background auto``, the default; with ``--threads 1`` on two cores or more it
does); ``--background off`` reduces in the hooks, ``on`` always on the worker. The memory steps
always reduce in the hooks: the torch profiler does not see the worker thread's frees.

With ``--optimizer`` the workload's optimizer is passed to ``inject_observer`` too, so a sampled
step also records the optimizer step signals (parameters, gradients, updates, optimizer state);
``--step-signals`` (comma-separated, implies ``--optimizer``) records only those;
``--record-inputs`` and ``--profile`` turn on those ``inject_observer`` options.

The unsampled step's cost is below what whole steps can resolve here, so it is also timed
directly: ``begin_step``, the root module's two hooks and ``end_step``, which is all an
unsampled step runs, around a model that does nothing, against the same model unobserved.

Reported per workload: the median plain step; each ratio as the median of the per-round ratios,
with the interquartile range of those ratios; and the ratio amortized over the adapters'
default cadence (one sampled step in 50), computed, not measured, as
``(48 * (1 + u / plain) + after + sampled) / 50`` with ``u`` the directly timed unsampled cost,
``sampled`` the median sampled ratio and ``after`` the median ratio of the step after a sampled
one (at least ``1 + u / plain``; whole unsampled steps scatter by several per cent here, more
than the 1 % at stake). The sampled step and the one after it carry everything a sample costs
on the training thread (hooks, reductions, the rows, the writer). Beside the sampled ratio, the
median of the sampled step over the observed copy's own unsampled step of the same round: the
two copies' memory alone can make them differ by up to about 15 % on this machine (the MLP's
observed copy ran its unsampled steps at 0.94x and at 1.15x of the plain copy's in two runs on
2026-12-04, its observer doing nothing there), so where the unsampled ratio strays from 1.0x
this column tells what the sample itself costs.

Then two more steps of each configuration run under the torch profiler
(``testing.tensor_memory``), the second measured: its peak tensor memory above what was
allocated when it started, what it left allocated, and the memory target: a sampled step's
peak at most the largest activation (in float32) above the plain step's.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import tempfile
import time
import timeit
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _extra_workloads
import torch
from _overhead_workloads import WORKLOADS, Workload, build
from _paired_memory import MemoryResult, largest_activation, measure_memory, print_memory
from _warmup import SECONDS, warm_up

if TYPE_CHECKING:
    from collections.abc import Callable

CONFIGURATIONS = ("plain", "unsampled", "sampled")
AFTER = "after"
"""The unsampled step that follows each sampled step: what the sample's work left for it (the
run directory's writer starts on a sample once its step is over) is counted there."""
_ROUND_UNITS = (("plain",), ("unsampled",), ("sampled", AFTER))
"""A round's steps: the units rotate from round to round; a sampled step is always followed by
the observed model's next, unsampled step."""
_BACKGROUND = {"auto": None, "on": True, "off": False}
"""``--background``: the ``background_reductions`` option of ``inject_observer``."""
CADENCE = 50
"""The adapters' default ``every_n_steps``: one sampled step in 50."""
SAMPLED_TARGET = 1.25
AMORTIZED_TARGET = 1.01
GROUPS = ("all", "extra")
"""``--workload`` choices naming several workloads: the targets' four (five on CUDA), or the
extra ones of other shapes (``_extra_workloads``)."""


@dataclass(frozen=True, slots=True)
class Ratio:
    """The median of per-round ratios to the plain step, and their interquartile range."""

    median: float
    q1: float
    q3: float


@dataclass(frozen=True, slots=True)
class WorkloadResult:
    """What one workload measured: the median plain step and the two ratios."""

    name: str
    plain_ms: float
    unsampled: Ratio
    sampled: Ratio
    after: Ratio
    """The unsampled step right after a sampled one."""
    own: Ratio
    """The sampled step over the observed copy's own unsampled step of the same round."""

    def amortized(self, unsampled_s: float) -> float:
        """The ratio of an average step when one step in ``CADENCE`` is sampled.

        The sampled step, the measured step after it (which carries what the sample's work left
        for later), and ``CADENCE - 2`` unsampled steps.

        Args:
            unsampled_s: What the observer adds to an unsampled step, timed directly.
        """
        unsampled = 1 + unsampled_s / (self.plain_ms / 1000)
        after = max(self.after.median, unsampled)
        return ((CADENCE - 2) * unsampled + after + self.sampled.median) / CADENCE


def _step(
    configuration: str, plain: Workload, observed: Workload, observer: object, step: int
) -> float:
    workload = plain if configuration == "plain" else observed
    configuration = "unsampled" if configuration == AFTER else configuration
    cuda = next(workload.model.parameters()).is_cuda
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    if configuration != "plain":
        observer.begin_step(step, sample=configuration == "sampled")  # type: ignore[attr-defined]
    workload.step()
    if configuration != "plain":
        observer.end_step()  # type: ignore[attr-defined]
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _unsampled_cost(repeats: int) -> float:
    """What the observer adds to an unsampled step, timed on a model that does nothing.

    An unsampled step runs ``begin_step``, the root module's two hooks and ``end_step``; no
    per-module hook is registered. Their cost does not depend on the model, so timing them
    around ``nn.Identity`` measures it to the microsecond, which whole steps cannot here.
    """
    from torchinstruments_core import inject_observer
    from torchinstruments_core.testing import RecordingSink

    plain, observed = torch.nn.Identity(), torch.nn.Identity()
    observer = inject_observer(observed, sink=RecordingSink())
    example = torch.ones(1)
    counter = iter(range(10**9))

    def observed_step() -> None:
        observer.begin_step(next(counter), sample=False)
        observed(example)
        observer.end_step()

    def best(step: Callable[[], object]) -> float:
        return min(timeit.repeat(step, number=repeats, repeat=5)) / repeats

    plain_s, observed_s = best(lambda: plain(example)), best(observed_step)
    observer.remove()
    return max(observed_s - plain_s, 0.0)


def _ratio(times: list[float], plain: list[float]) -> Ratio:
    ratios = [t / p for t, p in zip(times, plain, strict=True)]
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    return Ratio(q2, q1, q3)


def _observe(args: argparse.Namespace, observed: Workload, folder: str) -> object:
    from torchinstruments_core import MomentsReducer, QuantileReducer, Reducer, inject_observer
    from torchinstruments_core.testing import RecordingSink

    reducers: list[Reducer] | None = (
        [MomentsReducer(), QuantileReducer(exact=True)] if args.exact_quartiles else None
    )
    destination: dict[str, Any] = (
        {"sink": RecordingSink()}
        if args.sink == "recording"
        else {"output_dir": Path(folder) / "run"}
    )
    signals = {} if args.step_signals is None else {"step_signals": args.step_signals}
    return inject_observer(
        observed.model,
        reducers=reducers,
        optimizer=observed.optimizer if args.optimizer else None,
        **signals,
        record_inputs=args.record_inputs,
        profile=args.profile,
        background_reductions=_BACKGROUND[args.background],
        **destination,
    )


def _measure(
    args: argparse.Namespace, name: str, device: torch.device
) -> tuple[WorkloadResult, MemoryResult | None]:
    """Run the rotating rounds of one workload; then, unless told not to, its memory."""
    plain, observed = build(name, device), build(name, device)
    if args.compile:
        plain.model = torch.compile(plain.model)  # type: ignore[assignment]
        observed.model = torch.compile(observed.model)  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as folder:
        observer = _observe(args, observed, folder)
        times: dict[str, list[float]] = {c: [] for c in (*CONFIGURATIONS, AFTER)}

        def run_round(index: int) -> dict[str, float]:
            units = _ROUND_UNITS[index % 3 :] + _ROUND_UNITS[: index % 3]
            order = [c for unit in units for c in unit]
            return {c: _step(c, plain, observed, observer, index) for c in order}

        warmed = warm_up(run_round, args.warmup, args.warmup_seconds, name)
        for index in range(warmed, warmed + args.rounds):
            for configuration, seconds in run_round(index).items():
                times[configuration].append(seconds)
            print(f"{name}: round {index - warmed + 1}/{args.rounds}", file=sys.stderr, end="\r")
        print(file=sys.stderr)
        result = WorkloadResult(
            name,
            statistics.median(times["plain"]) * 1000,
            _ratio(times["unsampled"], times["plain"]),
            _ratio(times["sampled"], times["plain"]),
            _ratio(times[AFTER], times["plain"]),
            _ratio(times["sampled"], times["unsampled"]),
        )
        memory = None
        if args.memory:
            steps = {
                c: functools.partial(_step, c, plain, observed, observer) for c in CONFIGURATIONS
            }
            at = warmed + args.rounds
            # the torch profiler does not see frees on the CPU reduction worker's thread: the
            # memory steps reduce in the hook (the worker's own bound is tested instead)
            observer._config.measurer.background = False  # type: ignore[attr-defined]
            memory = measure_memory(steps, at, device, largest_activation(plain))
        observer.remove()  # type: ignore[attr-defined]
    return result, memory


def _print_table(
    args: argparse.Namespace, results: list[WorkloadResult], unsampled_s: float
) -> None:
    """One row per workload: plain step, the ratios, and the targets."""
    quartiles = "exact quartiles" if args.exact_quartiles else "default profile"
    compiled = ", both models compiled (inductor)" if args.compile else ""
    gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    extra = "".join(f", {o}" for o in ("optimizer", "record_inputs", "profile") if getattr(args, o))
    if args.step_signals is not None:
        extra += f" ({', '.join(args.step_signals)})"
    extra += f", background reductions {args.background}"
    print(f"\nobserved with the {quartiles}, {args.sink}{compiled}{extra}")
    print(f"{args.threads} thread(s), {args.rounds} rounds per workload")
    print(f"{platform.processor() or platform.machine()}{gpu}, torch {torch.__version__}\n")
    print(
        "| workload | plain step (ms) | unsampled, median of rounds (IQR) | sampled, median of "
        "rounds (IQR) | sampled over its copy's unsampled step | the step after a sampled one (IQR) "
        f"| every {CADENCE} steps (computed) | sampled <= {SAMPLED_TARGET}x "
        f"| every {CADENCE} <= {AMORTIZED_TARGET}x |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for result in results:
        u, s, a, o = result.unsampled, result.sampled, result.after, result.own
        amortized = result.amortized(unsampled_s)
        sampled_met = "met" if s.median <= SAMPLED_TARGET else "NOT met"
        amortized_met = "met" if amortized <= AMORTIZED_TARGET else "NOT met"
        print(
            f"| {result.name} | {result.plain_ms:.1f} | {u.median:.3f}x ({u.q1:.3f}-{u.q3:.3f})"
            f" | {s.median:.3f}x ({s.q1:.3f}-{s.q3:.3f}) | {o.median:.3f}x"
            f" | {a.median:.3f}x ({a.q1:.3f}-{a.q3:.3f})"
            f" | {amortized:.4f}x | {sampled_met} | {amortized_met} |"
        )
    fastest = min(r.plain_ms for r in results) / 1000
    print(
        f"\nunsampled step, observer's own time (begin_step, root hooks, end_step; best of 5): "
        f"{unsampled_s * 1e6:.1f} us, {1 + unsampled_s / fastest:.6f}x of the fastest plain step"
    )
    for result in results:
        print(f"{result.name}: {WORKLOADS[result.name].description}")


def _workloads(name: str, device: str) -> list[str]:
    """``all``: the targets' workloads that run on ``device``; ``extra``: the others."""
    if name not in GROUPS:
        return [name]
    extra = name == "extra"
    return [
        w
        for w, spec in WORKLOADS.items()
        if spec.extra == extra and (device == "cuda" or not spec.cuda_only)
    ]


def parser() -> argparse.ArgumentParser:
    """The command line (a function, so that a flag is one more ``add_argument``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="all", choices=[*GROUPS, *sorted(WORKLOADS)])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3, help="rounds first, at the least")
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=SECONDS,
        help="seconds of warm-up rounds at the least (the writer process starts meanwhile)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--probe-repeats", type=int, default=20000, help="timed calls for the unsampled cost"
    )
    parser.add_argument(
        "--exact-quartiles", action="store_true", help="QuantileReducer(exact=True): sort it all"
    )
    parser.add_argument("--sink", choices=["run-directory", "recording"], default="run-directory")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile both models; observe the compiled"
    )
    parser.add_argument(
        "--no-memory", dest="memory", action="store_false", help="skip the profiled memory steps"
    )
    parser.add_argument(
        "--optimizer", action="store_true", help="also record the optimizer step signals"
    )
    parser.add_argument(
        "--step-signals",
        type=lambda text: tuple(name for name in text.split(",") if name),
        default=None,
        help="only these step signals, comma-separated (implies --optimizer)",
    )
    parser.add_argument(
        "--background",
        choices=sorted(_BACKGROUND),
        default="auto",
        help="background_reductions: auto (a free core), on, off (reduce in the hook)",
    )
    parser.add_argument("--record-inputs", action="store_true", help="inject_observer option")
    parser.add_argument("--profile", action="store_true", help="inject_observer option")
    return parser


def main() -> None:
    arguments = parser()
    args = arguments.parse_args()
    args.optimizer = args.optimizer or args.step_signals is not None
    if args.step_signals is not None:
        from torchinstruments_core import ConfigurationError
        from torchinstruments_core._optimizer_probe import parse_step_signals

        try:
            parse_step_signals(args.step_signals)
        except ConfigurationError as error:
            arguments.error(f"--step-signals: {error}")
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        arguments.error("--device cuda: CUDA is not available on this machine")
    if args.workload not in GROUPS and WORKLOADS[args.workload].cuda_only and args.device != "cuda":
        arguments.error(f"--workload {args.workload}: needs --device cuda (a GPU)")
    for name in _workloads(args.workload, args.device):  # before any is measured
        package = _extra_workloads.missing(name)
        if package is not None:
            arguments.error(f"--workload {name}: needs {package} (uv sync installs it)")
    device = torch.device(args.device)
    results: list[WorkloadResult] = []
    memory: dict[str, MemoryResult] = {}
    for name in _workloads(args.workload, args.device):
        result, used = _measure(args, name, device)
        results.append(result)
        if used is not None:
            memory[name] = used
    _print_table(args, results, _unsampled_cost(args.probe_repeats))
    if memory:
        print_memory(memory)


if __name__ == "__main__":
    main()
