from common.memory.cli import main

main()
