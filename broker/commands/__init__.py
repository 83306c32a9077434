"""The ``cobald-remote`` commands: argument parsing and printing only"""
