"""Standard-library names that Python 3.10 and 3.11 removed, restored for old repositories.

Copied into an instance venv (as `openglm_stdlib_compat.py`, imported by a `.pth` file) when the
instance asks for it (`openglm_env.stdlib_compat`): projects written for Python 3.6-3.8 import
`inspect.getargspec` or `collections.Mapping` at import time, and the harness has only the
interpreter it runs on. Each name is added only where it is missing, as an alias of its documented
replacement; nothing that exists is changed. This file must import nothing but the standard library.
"""

import collections
import collections.abc
import inspect

# collections.Mapping & co.: aliases of collections.abc, removed in Python 3.10
for _name in collections.abc.__all__:
    if not hasattr(collections, _name):
        setattr(collections, _name, getattr(collections.abc, _name))

# inspect.getargspec: removed in Python 3.11; getfullargspec without the keyword-only parts
if not hasattr(inspect, "getargspec"):
    ArgSpec = collections.namedtuple("ArgSpec", "args varargs keywords defaults")

    def getargspec(func):
        spec = inspect.getfullargspec(func)
        return ArgSpec(spec.args, spec.varargs, spec.varkw, spec.defaults)

    inspect.ArgSpec = ArgSpec
    inspect.getargspec = getargspec
