// The Catch2 runner for dvr-unit-tests; the tests live in the other files here.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
