# A package so this directory's conftest.py does not take the module name `conftest` from
# tests/conftest.py (test_lifecycle.py imports DaemonProcess from it).
