"""verl_moe.configs"""
