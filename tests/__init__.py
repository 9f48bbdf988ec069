"""The test suite as a package: tests/unit/<part>/ mirrors kvstore's parts,
tests/integration/ starts real processes, servers or sockets. Shared helpers
import by their full name (``from tests.conftest import wait_until``), and
test files in different folders may share a name."""
