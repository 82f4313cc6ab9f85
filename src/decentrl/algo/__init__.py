"""decentrl.algo"""
