"""Test setup: on a machine without a GPU, run the Triton kernels in the interpreter.

``TRITON_INTERPRET`` must be set before the kernel modules are imported, so it is
set here, before any test imports ``na3d``. On a GPU machine the kernels compile for
the GPU and the ``gpu`` tests exercise them; without one they are skipped.
"""

import os
import sys


def share_the_cores_among_workers():
    """Each of xdist's workers gets its share of the cores for PyTorch's and the BLAS
    libraries' thread pools (numpy's products run the interpreter's ``tl.dot``), set
    before either is imported: by default each pool takes every core, and on 2 cores
    two workers' pools fought over them (two test files 13 % slower)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, threads)


share_the_cores_among_workers()

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def patch_language_once_per_launch():
    """Triton 3.6's interpreter patches ``triton.language`` again at every call of a
    ``@triton.jit`` helper inside a kernel (a scan of the language modules' members,
    over a third of an interpreted kernel's CPU time), although the launch has
    patched the same modules already and the patches of such a call are never
    undone. Here a launch patches each language module once, the first time one of
    its functions needs it; everything else is the interpreter's own."""
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    patched = threading.local()  # ids of the language modules this launch has patched
    patch_lang, run_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__

    def patch_lang_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        done = getattr(patched, "langs", None)
        if done is not None and langs <= done:
            return interpreter._LangPatchScope()  # nothing to undo
        scope = patch_lang(fn)
        if done is not None:
            done |= langs
        return scope

    def launch(self, *args, **kwargs):
        outer, patched.langs = getattr(patched, "langs", None), set()
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            patched.langs = outer

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch


def no_overflow_checks():
    """The interpreter checks every 32-bit integer add, subtract and multiply for
    overflow (a cast to 64 bits, two compares and an assert each: about a third of
    an interpreted kernel's CPU time once the patching above is gone). Compiled
    kernels check nothing of the kind, and no interpreted test comes near 2**31
    (``test_more_than_2_31_elements`` runs the int64 offsets on a GPU): here the
    interpreter computes as the compiled kernels do."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def lazy_tuple_type_names():
    """The interpreter builds a tuple type for every ``tl.tuple`` (each of our named
    tuples, every time one is made or passes through a helper: hundreds of thousands
    per test) and formats its name on the spot, a string of every member's type,
    nested tuples recursively (one test, alternating: 23.8 / 18.6 s -> 19.6 / 17.4 s).
    The name is read only for messages; here it is formatted when read. The types,
    their equality and everything else are the interpreter's own."""
    from triton.language import core

    def tuple_type_init(self, types, fields=None):
        self.types = types
        self.fields = fields or [''] * len(types)

    core.tuple_type.__init__ = tuple_type_init
    core.tuple_type.name = property(
        lambda self: '[' + ','.join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + ']')


def lazy_tuple_types():
    """Every tensor the interpreter makes carries its shape as a ``tl.tuple`` of
    constexprs, and every ``tl.tuple`` built without a type computes one on the spot
    (a type per member): about 750,000 of them in one test, read for a small share.
    Here a tuple built without a type computes it the first time it is read; a tuple
    given one, and every assignment, are the interpreter's own."""
    from triton.language import core

    def tuple_init(self, args, type=None):
        self.values = [i for i in args]
        if isinstance(type, core.tuple_type):
            self.__dict__["_type"] = type
        elif type is not None:  # make_template in ASTFunction.deserialize may pass a list/tuple
            self.__dict__["_type"] = core.tuple_type(type)
        else:
            self.__dict__["_type"] = None

    def get_type(self):
        t = self.__dict__.get("_type")
        if t is None:
            t = self.__dict__["_type"] = core._type_for_tuple_values(self.values)
        return t

    def set_type(self, t):
        self.__dict__["_type"] = t

    core.tuple.__init__ = tuple_init
    core.tuple.type = property(get_type, set_type)


def lazy_tensor_shapes():
    """Every ``tl.tensor`` the interpreter makes (hundreds of thousands per test) builds
    its shape as a ``tl.tuple`` of constexprs and its element count as a constexpr on
    the spot; most are never read. Here both are built the first time they are read,
    from the tensor's type, as the interpreter builds them."""
    import math

    from triton.language import core

    def tensor_init(self, handle, type):
        self.handle = handle
        self.type = type
        self.dtype = type.scalar

    def block_shape(self):
        return self.type.shape if self.type.is_block() else ()

    def get_shape(self):
        found = self.__dict__.get("shape")
        if found is None:
            found = self.__dict__["shape"] = core.tuple([core.constexpr(s) for s in block_shape(self)])
        return found

    def get_numel(self):
        found = self.__dict__.get("numel")
        if found is None:
            found = self.__dict__["numel"] = core.constexpr(math.prod(block_shape(self)))
        return found

    def setter(name):
        def set_value(self, value):
            self.__dict__[name] = value
        return set_value

    core.tensor.__init__ = tensor_init
    core.tensor.shape = property(get_shape, setter("shape"))
    core.tensor.numel = property(get_numel, setter("numel"))


def numpy_dtypes_once():
    """The interpreter maps a Triton dtype to numpy's through a table it builds again
    at every call (19 ``np.dtype`` objects, about 100,000 calls in one test); here the
    table is built once. The mapping is the interpreter's own."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    table = {}
    original = interpreter._get_np_dtype

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return np.dtype(np.uint64)
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return np.dtype(np.uint64)
            tt_dtype = tt_dtype.element_ty
        found = table.get(tt_dtype)
        if found is None:
            found = table[tt_dtype] = original(tt_dtype)
        return found

    interpreter._get_np_dtype = get_np_dtype


# Only for the Triton the tests pin (the ``test`` extra), whose interpreter these mirror.
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton

    if triton.__version__ == "3.6.0":
        patch_language_once_per_launch()
        no_overflow_checks()
        lazy_tuple_type_names()
        lazy_tuple_types()
        lazy_tensor_shapes()
        numpy_dtypes_once()

sys.path.insert(0, os.path.dirname(__file__))


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject's default): xdist's count, one per core, but
    at most 4 on a machine with a GPU, whose memory the GPU tests' largest shapes
    share (more workers run out of it)."""
    if torch.cuda.is_available():
        return min(4, os.cpu_count() or 1)
    return None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    needs_gpu = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(needs_gpu)


# The GPU tests' largest shape: its forward and backward with their references hold
# about 27 GiB per test (1 x 79 x 192 x 192 tokens). Three at once ran an 80 GB card out
# of memory at -n 3 (NOTES v43); workers take it in turns.
ONE_AT_A_TIME_ON_A_GPU = ("ltx-stage5-tile",)


@pytest.fixture(autouse=True)
def largest_shapes_one_at_a_time(request):
    """On a GPU, a test of one of ``ONE_AT_A_TIME_ON_A_GPU`` (by its id) holds a lock
    file that every pytest worker of this user shares, so that no two of them share
    the card's memory, and returns the memory its worker cached before letting go;
    everything else runs as before, in parallel."""
    if not torch.cuda.is_available() or not any(name in request.node.name for name in ONE_AT_A_TIME_ON_A_GPU):
        yield
        return
    import fcntl
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"na3d-tests-gpu-memory-{os.getuid()}.lock")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            # PyTorch's allocator keeps what the test freed; give it back before the next one.
            import gc

            gc.collect()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def exact_reference_backend(monkeypatch):
    """na3d's CPU calls take its exact PyTorch reference instead of the Triton interpreter.

    ``na3d.api`` asks ``launch.kernels_interpreted()`` to choose; without the interpreter
    CPU tensors go to ``na3d_sdpa_exact``, the documented CPU behavior (what a CPU user
    gets). For model-level tests, where the interpreter would take minutes.
    """
    from na3d import launch

    monkeypatch.setattr(launch, "kernels_interpreted", lambda: False)
