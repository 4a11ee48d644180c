"""The baseline methods (source, bn_adapt, tent, eata, sar, cotta, lame), one small class
each; the paper methods live in their rooms. `build_method` & co. are the registry's
(tta_core.registry), re-exported here because most callers look for them here.
"""

from tta_core.registry import available_methods, build_method, method_class, register

__all__ = ["available_methods", "build_method", "method_class", "register"]
