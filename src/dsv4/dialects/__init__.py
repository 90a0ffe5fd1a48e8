"""Other projects' spellings of DeepSeek-V4 configs and checkpoint names, mapped to dsv4's."""
