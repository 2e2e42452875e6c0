"""The package version; the build checks that it equals the version in Cargo.toml."""

__version__ = "0.1.0"
