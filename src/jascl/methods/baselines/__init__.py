"""The paper's comparison methods, each a list of plugins on the same loop.

Every module in this package registers its methods in :data:`jascl.methods.registry.METHODS`
when imported; all modules are imported here, so adding a baseline is adding a file.

Conventions every baseline follows:

* a pure loss / rule function tested on bare tensors, a plugin wiring it into the
  loop, and a registered factory ``fn(config) -> Method``;
* options live in a dataclass read with :func:`jascl.engine.config.method_options`
  (``--set method_args.<method>.<option>=value``);
* each plugin lists the ``state.losses`` keys it adds in ``loss_terms`` (the registry
  test checks that they are non-zero in the incremental session);
* the docstring cites the original paper and states every deviation from it.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")
