from cli.main import main

main(prog_name="minigpt")
