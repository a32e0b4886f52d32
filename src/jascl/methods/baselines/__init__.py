"""The paper's comparison methods, each a list of plugins on the same loop.

Every module in this package (family folders included) registers its methods in
:data:`jascl.methods.registry.METHODS` when imported; all modules are imported here, so
adding a baseline is adding a file (modules whose name starts with ``_`` hold what a
family shares and register nothing).

Conventions every baseline follows:

* a pure loss / rule function tested on bare tensors, a plugin wiring it into the
  loop, and a registered factory;
* options are a dataclass registered with the method (``METHODS.register(name,
  options=...)``), their ranges declared with :func:`jascl.methods.options.option` and
  read from ``--set method_args.<method>.<option>=value``;
* each plugin lists the ``state.losses`` keys it adds in ``loss_terms`` (the registry
  test checks that they are non-zero in the incremental session);
* the docstring cites the original paper and states every deviation from it.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.walk_packages(__path__, prefix=f"{__name__}.")):
    if not _module.rsplit(".", 1)[-1].startswith("_"):
        importlib.import_module(_module)
