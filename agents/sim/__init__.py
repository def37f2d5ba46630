"""The simulator every test and the demo use in place of GPUs.

agents.sim.vllm        a simulated vLLM server (`python -m haru.agents.sim.vllm serve ...`; its parts in
                       vllm_config, vllm_profile, vllm_engine, vllm_completions, vllm_app)
agents.sim.trainer     a simulated trainer (`python -m haru.agents.sim.trainer --vram 8GiB`)
agents.sim.gpu_state   the simulated GPU state file (SimGpuState), shared by all of them
"""

from haru.agents.sim.errors import BadSize, NoSimGpu, SimError
from haru.agents.sim.gpu_state import SimGpuState, parse_size

__all__ = ["BadSize", "NoSimGpu", "SimError", "SimGpuState", "parse_size"]
