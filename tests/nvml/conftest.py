from __future__ import annotations

import pytest

from tests.nvml.fake import Reader, build


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory):
    """The directory of the compiled fake `libnvidia-ml.so.1` (cached across sessions)."""
    return build(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture
def nvml_reader(fake_nvml_dir, tmp_path):
    """Start a reader over the fake NVML with the given state lines; every reader is stopped at the end."""
    from tests.nvml.fake import write_state

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
