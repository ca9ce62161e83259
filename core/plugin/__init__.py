"""Plugins around the core: one pluggy ``PluginManager`` per engine and the guard that contains plugin faults.

The hook specifications themselves (the contract) are ``pagedkv.core.hookspecs``. Imports only the
foundation modules of ``pagedkv.core``.
"""
