"""Lightning callbacks that catch or fix multi-device training mistakes."""
