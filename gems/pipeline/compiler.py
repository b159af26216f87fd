"""Whether and how this machine compiles (``--compile``, ``gems.pipeline.compiled``): the backend's tools
present (``check_backend``: a C++ compiler on CPU, triton on CUDA), a plan that can run compiled
(``check``), and the compiler's caches (``use_cache``: inductor's FX graph cache, AOTAutograd's cache,
triton's) in a directory kept across runs, so a resumed job does not compile from scratch."""
from __future__ import annotations

import importlib.util
import os

import torch

from gems.errors import GemsError


def check_backend(device: torch.device | str) -> None:
    """GemsError, one sentence naming what is missing, when inductor cannot compile for ``device``:
    a C++ compiler on CPU (``CXX`` or g++), triton on CUDA."""
    kind = torch.device(device).type
    if kind == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise GemsError("--compile needs triton for torch.compile's inductor backend on CUDA, and it is not "
                            "installed: install triton (pip install triton) or drop --compile")
        return
    from torch._inductor import config, cpp_builder  # noqa: PLC0415 - inductor loads only with --compile
    from torch._inductor.exc import InvalidCxxCompiler  # noqa: PLC0415

    try:
        cpp_builder.get_cpp_compiler()
    except InvalidCxxCompiler:
        tried = " or ".join(c for c in config.cpp.cxx if c) or "none"
        raise GemsError(f"--compile needs a C++ compiler for torch.compile's inductor backend on CPU, and {tried} "
                        "does not run here (CXX names the compiler): install g++ or set CXX to a working one, or "
                        "drop --compile") from None


def check(plan, device: torch.device | str) -> None:
    """GemsError unless ``plan`` can run compiled on ``device``: its backward not split (a compiled
    unit's backward is one autograd node), the backend's tools present (``check_backend``)."""
    if plan.split_backward:
        raise GemsError("the plan splits the backward, which a compiled unit's backward (one autograd node) "
                        "cannot be: make the plan with --compile (gems-plan --compile) or drop --compile")
    if any(p.state_placement == "host" for p in plan.policies):
        # a compiled graph guards on its parameters' storage and lifts them as inputs saved whole for its
        # one backward node, which the per-group swapping of gems.pipeline.hostweights empties in between
        raise GemsError("--compile cannot run stages whose parameters live in host memory (--state-placement "
                        "host), whose device storage is emptied between uses: drop --compile or place the state "
                        "with --state-placement host-optimizer")
    check_backend(device)


def use_cache(directory: str | os.PathLike) -> str:
    """Keep the compiler's caches in ``directory`` (made if missing): inductor's FX graph cache, the
    AOTAutograd cache and triton's kernels; call it before the first compile. Returns the path."""
    path = os.path.abspath(os.fspath(directory))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise GemsError(f"the compile cache directory {path} cannot be made ({error.strerror}): pass "
                        "--compile-cache with a writable directory") from None
    os.environ.update({"TORCHINDUCTOR_CACHE_DIR": path, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
                       "TORCHINDUCTOR_AUTOGRAD_CACHE": "1", "TRITON_CACHE_DIR": os.path.join(path, "triton")})
    from torch._functorch import config as functorch_config  # noqa: PLC0415 - read at import: set them too
    from torch._inductor import config as inductor_config  # noqa: PLC0415

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return path
