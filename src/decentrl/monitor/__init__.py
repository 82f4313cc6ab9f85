"""decentrl.monitor"""
