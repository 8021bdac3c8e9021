"""rlhf_core/rollout/huge_pages.py: ranges are merged and aligned to whole huge pages, and `collapse` moves a
tensor's memory onto huge pages in place (where the kernel offers MADV_COLLAPSE), its values unchanged."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from rlhf_core.rollout.huge_pages import aligned_inside, collapse_into_huge_pages, merged

MIB = 1024 * 1024


def test_ranges_closer_than_a_huge_page_are_merged() -> None:
    spans = [(10 * MIB, 11 * MIB), (0, 3 * MIB), (3 * MIB + 5, 4 * MIB), (20 * MIB, 21 * MIB)]
    assert merged(spans, gap=2 * MIB) == [(0, 4 * MIB), (10 * MIB, 11 * MIB), (20 * MIB, 21 * MIB)]


def test_only_whole_aligned_huge_pages_inside_a_range_are_used() -> None:
    assert aligned_inside((1, 7 * MIB), 2 * MIB) == (2 * MIB, 6 * MIB)
    assert aligned_inside((1 * MIB, 3 * MIB), 2 * MIB) is None


def anon_huge_kib(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings overlapping [start, end), from /proc/self/smaps."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:
            low, high = (int(part, 16) for part in first.split("-"))
            inside = low < end and high > start
        elif inside and first == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def thp_mode() -> str | None:
    """The system-wide transparent huge page mode (always, madvise, never), None off Linux."""
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not enabled.is_file():
        return None
    return enabled.read_text().split("[")[1].split("]")[0]


@pytest.mark.skipif(thp_mode() in (None, "never"), reason="transparent huge pages are not available here")
def test_collapse_moves_a_tensor_onto_huge_pages_and_keeps_its_values() -> None:
    """On fresh pages of a mapping of its own: the heap may already hold huge pages another test collapsed."""
    mapping = mmap.mmap(-1, 34 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(mapping, dtype=torch.float32)
    tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32))  # written, page by page
    expected = tensor.clone()
    start = tensor.data_ptr()
    end = start + 34 * MIB
    before = anon_huge_kib(start, end)
    collapsed = collapse_into_huge_pages([(start, end)])
    if collapsed == 0:
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux < 6.1) or no huge page was free")
    assert collapsed >= 32 * MIB  # every whole huge page inside the 34 MiB
    after = anon_huge_kib(start, end)
    if thp_mode() == "madvise":  # fresh pages were small: all the huge pages are the collapse's
        assert after - before >= collapsed // 1024
    assert after >= collapsed // 1024
    assert torch.equal(tensor, expected)
    del tensor
    mapping.close()
