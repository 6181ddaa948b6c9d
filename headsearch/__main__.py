from headsearch.cli.main import main

main()
