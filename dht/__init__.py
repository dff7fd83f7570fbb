"""The DHT layer: identities, signed membership records, admission, and hivemind's DHT and P2P started for a
node (``launch``, ``swarm``).

hivemind's own ``__init__`` imports everything it has: the averager (and through its load balancing, scipy),
the mixture-of-experts server and the optimizer, none of which a node uses. Importing the node's agent took
4.3-4.4 s of an idle core with them and 3.2-3.6 s without, in every node process at every start. So, unless
something imported hivemind first, an import of hivemind after this package's loads the package without
running its ``__init__``: ``hivemind.dht``, ``hivemind.p2p`` and ``hivemind.utils`` load as usual, and the
first read of any other name of the package (``hivemind.Optimizer``, ``from hivemind import
DecentralizedAverager``) runs its ``__init__`` then: code in the same process that wants the rest of
hivemind still gets it (``tests/test_dht_swarm.py``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class _LeanHivemind(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the ``hivemind`` package once (then leaves ``sys.meta_path``) and loads it without its ``__init__``;
    a module ``__getattr__`` runs that on the first read of a name the package itself defines."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "hivemind":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("hivemind")
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            return spec  # not installed, or not the package we know: the usual import says what it is
        lean = importlib.util.spec_from_file_location(
            "hivemind", spec.origin, loader=self, submodule_search_locations=spec.submodule_search_locations
        )
        self.real = spec.loader
        return lean

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module) -> None:
        real = self.real

        def __getattr__(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            sub = sys.modules.get(f"hivemind.{name}")
            if sub is not None:  # a subpackage still loading (``import hivemind.p2p.x as y`` reads it here)
                return sub
            del module.__dict__["__getattr__"]
            real.exec_module(module)  # the whole of hivemind, on first use of a name it defines
            return getattr(module, name)

        module.__getattr__ = __getattr__


if "hivemind" not in sys.modules and not any(isinstance(f, _LeanHivemind) for f in sys.meta_path):
    sys.meta_path.insert(0, _LeanHivemind())
