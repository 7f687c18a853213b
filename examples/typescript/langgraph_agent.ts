// A LangGraph.js ReAct agent (ChatOpenAI + one tool), in its own process: no tracerl inside.
// Run by a tracerl rollout with the rollout's gateway in its environment (OPENAI_BASE_URL,
// OPENAI_API_KEY, TRACERL_MODEL): every model call of the graph joins that rollout's trajectory.
//
//   npx tsx langgraph_agent.ts "Add 17 and 25."
import { tool } from "@langchain/core/tools";
import { GraphRecursionError } from "@langchain/langgraph";
import { createReactAgent } from "@langchain/langgraph/prebuilt";
import { ChatOpenAI } from "@langchain/openai";
import { z } from "zod";

const add = tool(async ({ a, b }: { a: number; b: number }) => String(a + b), {
  name: "add",
  description: "Add two integers.",
  schema: z.object({ a: z.number().int(), b: z.number().int() }),
});

const llm = new ChatOpenAI({
  model: process.env.TRACERL_MODEL ?? "policy",
  temperature: 1.0,
  maxTokens: 48,
  maxRetries: 0,
  configuration: { baseURL: process.env.OPENAI_BASE_URL, apiKey: process.env.OPENAI_API_KEY },
});
const agent = createReactAgent({ llm, tools: [add], prompt: "You add numbers with the add tool, then answer with the sum." });
const result = await agent.invoke(
  { messages: [{ role: "user", content: process.argv[2] ?? "Add 2 and 3." }] },
  { recursionLimit: 6 },
).catch((error: Error) => {
  if (error instanceof GraphRecursionError) return { messages: [{ content: "" }] }; // the policy looped: no answer
  throw error; // anything else (the endpoint down...) fails the process, and so the rollout
});
const last = result.messages[result.messages.length - 1];
console.log(JSON.stringify({ answer: typeof last.content === "string" ? last.content : "" }));
