"""The policies that rank candidates: :mod:`~attnselect.policies.rules` (preference tables, the default),
:mod:`~attnselect.policies.measure` (timed on this machine), and :mod:`~attnselect.policies.te`
(TransformerEngine's selection emulated on attnselect's verdicts: a comparison for ``attnselect bench``)."""
