"""The paper's comparison methods, each a list of plugins on the same loop.

Every module in this package (family folders included) registers its methods in
:data:`jascl.methods.registry.METHODS` when imported (modules whose name starts with ``_``
hold what a family shares and register nothing). None is imported here: the registry lists
the methods from its index and imports a method's module on first use, so adding a baseline
is adding a file and running ``python tools/registry_index.py`` (``tests/test_registry_index.py``
fails until the index lists it).

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
