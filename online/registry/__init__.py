"""The drafter registry on MLflow (`versions`: runs, registered versions, aliases, artifacts), the
figures logged with each round (`plots`) and the MLflow UI over its stores (`ui`)."""

from online.registry.ui import UiServer, start_ui
from online.registry.versions import (
    CHAMPION,
    DRAFTER_ARTIFACTS,
    GGUF_ARTIFACT,
    PREVIOUS,
    SPECULATORS_ARTIFACTS,
    TRAINEE,
    DrafterRegistry,
    LocalDrafter,
    LoggedRound,
    RegistryError,
    RegistrySettings,
    VersionInfo,
)

__all__ = ["CHAMPION", "DRAFTER_ARTIFACTS", "GGUF_ARTIFACT", "PREVIOUS", "SPECULATORS_ARTIFACTS", "TRAINEE",
           "DrafterRegistry", "LocalDrafter", "LoggedRound", "RegistryError", "RegistrySettings", "UiServer",
           "VersionInfo", "start_ui"]
