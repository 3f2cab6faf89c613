"""verl_moe.engines"""
