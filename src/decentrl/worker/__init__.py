"""decentrl.worker"""
