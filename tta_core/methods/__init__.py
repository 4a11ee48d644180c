"""The baseline methods (source, bn_adapt, tent, eata, sar, cotta, lame), one small class
each; the paper methods live in their rooms. Build any of them by name with
`tta_core.registry.build_method`. Each module registers its class with
`tta_core.registry.register`; the registry finds the modules by name, and this package
re-exports nothing, so the registry and the baselines do not import each other.
"""
