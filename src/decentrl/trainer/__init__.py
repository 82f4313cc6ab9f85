"""decentrl.trainer"""
