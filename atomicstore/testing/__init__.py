"""Test support shipped with the package: object-store fakes and fault injection."""
