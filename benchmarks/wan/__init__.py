"""`decentrl bench wan`: an emulated internet fleet on one machine."""
