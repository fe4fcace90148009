"""client_sdk"""
