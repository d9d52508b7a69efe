#pragma once
constexpr long kAnswer = 42;
