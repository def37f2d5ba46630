from __future__ import annotations

import pytest

from tests.support.nvml_fake import Reader, write_state


@pytest.fixture
def nvml_reader(fake_nvml_dir, tmp_path):
    """Start a reader over the fake NVML with the given state lines; every reader is stopped at the end."""
    readers: list[Reader] = []
    state = tmp_path / "nvml-state"

    def start(lines: list[str] | None) -> tuple[Reader, object]:
        if lines is not None:
            write_state(state, lines)
        reader = Reader(fake_nvml_dir, state)
        readers.append(reader)
        return reader, lambda new: write_state(state, new)

    yield start
    for r in readers:
        r.stop()
