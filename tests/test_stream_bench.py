"""M9c's consumer (`stream_bench.Drainer`): a process of its own that drains requests' rows,
streamed or whole, as a next stage does, and reports what failed there to the bench."""

from __future__ import annotations

import pytest
import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import open_channel
from prefix_cache.tools.stream_bench import Drainer


def test_the_drainer_process_takes_every_chunk_and_whole_entry_and_names_a_failure() -> None:
    with open_channel("shm") as channel:
        drainer = Drainer(channel)
        try:
            for start in (0, 3):
                channel.put("streamed", {HIDDEN_KEY: torch.ones(3, 4)}, start=start,
                            final=start == 3)
            channel.put("whole", {HIDDEN_KEY: torch.ones(5, 4)})
            drainer.start(["streamed"], True)
            drainer.wait(60)
            drainer.start(["whole"], False)
            drainer.wait(60)
            assert channel.used_bytes() == 0  # every entry taken, none left behind
            channel.fail("failed", "the stage broke")
            drainer.start(["failed"], False)
            with pytest.raises(RuntimeError, match="drainer process failed: .*the stage broke"):
                drainer.wait(60)
        finally:
            drainer.close()
