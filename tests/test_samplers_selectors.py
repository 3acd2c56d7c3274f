"""Samplers, selectors and module names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchinstruments_core import (
    ConfigurationError,
    EveryNForwardsSampler,
    IntervalSampler,
    all_of,
    any_of,
    by_name,
    by_type,
    leaf_modules,
)
from torchinstruments_core._names import named_modules_clean


def test_every_n_forwards_with_offset() -> None:
    """EveryNForwardsSampler takes offset, offset+n, offset+2n …."""
    sampler = EveryNForwardsSampler(4, offset=2)
    assert [i for i in range(15) if sampler.should_sample(i)] == [2, 6, 10, 14]


def test_interval_sampler_counts_from_the_last_sample() -> None:
    """IntervalSampler takes the first forward, then the first after each interval."""
    now = [0.0]
    sampler = IntervalSampler(10.0, clock=lambda: now[0])
    taken = []
    for t in [0.0, 5.0, 9.9, 10.0, 12.0, 25.0, 30.0, 35.1]:
        now[0] = t
        taken.append(sampler.should_sample(0))
    assert taken == [True, False, False, True, False, True, False, True]


@pytest.mark.parametrize(
    ("factory", "arg"),
    [(EveryNForwardsSampler, 0), (EveryNForwardsSampler, 1.5), (IntervalSampler, -1)],
)
def test_sampler_arguments_are_validated(factory: type, arg: object) -> None:
    """Samplers reject values that cannot work, naming them."""
    with pytest.raises(ConfigurationError, match=repr(arg)):
        factory(arg)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        self.module = nn.Linear(2, 2)  # a user's own attribute called "module"
        self.head = nn.Linear(2, 1)


def _select(selector: object) -> list[str]:
    return [n for n, m in named_modules_clean(Net()) if selector(n, m)]  # type: ignore[operator]


def test_selectors_and_their_combinations() -> None:
    """leaf_modules, by_type, by_name and &, |, ~, all_of, any_of select what they say."""
    assert _select(leaf_modules()) == ["encoder.0", "encoder.1", "module", "head"]
    assert _select(by_type(nn.Linear)) == ["encoder.0", "module", "head"]
    assert _select(by_name("encoder.*")) == ["encoder.0", "encoder.1"]
    assert _select(leaf_modules() & ~by_type(nn.ReLU)) == ["encoder.0", "module", "head"]
    assert _select(by_name("head") | by_type(nn.ReLU)) == ["encoder.1", "head"]
    assert _select(all_of(leaf_modules(), by_name("e*"))) == ["encoder.0", "encoder.1"]
    assert _select(any_of(by_name("head"), lambda n, m: n == "module")) == ["module", "head"]
    assert repr(leaf_modules() & ~by_type(nn.ReLU)) == "(leaf_modules() & ~by_type(ReLU))"


def test_selector_arguments_are_validated() -> None:
    """Selector factories reject empty or wrong arguments."""
    with pytest.raises(ConfigurationError):
        by_type(int)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        by_name()
    with pytest.raises(ConfigurationError):
        any_of()


def test_wrapper_attributes_are_removed_from_names() -> None:
    """Names under torch.compile and checkpoint wrappers are the model's own; 'module' stays."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = Net()
    net.encoder = checkpoint_wrapper(net.encoder)  # type: ignore[assignment]
    compiled: nn.Module = torch.compile(net)  # type: ignore[assignment]
    names = [n for n, _ in named_modules_clean(compiled)]
    assert names == ["<root>", "encoder", "encoder.0", "encoder.1", "module", "head"]
    assert "_orig_mod.encoder._checkpoint_wrapped_module.0" in dict(compiled.named_modules())


def test_ddp_prefix_is_removed(tmp_path: object) -> None:
    """Under DistributedDataParallel the 'module.' prefix is removed (real gloo group of one)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    wrapped = nn.parallel.DistributedDataParallel(Net())
    names = [n for n, _ in named_modules_clean(wrapped)]
    assert names == ["<root>", "encoder", "encoder.0", "encoder.1", "module", "head"]
